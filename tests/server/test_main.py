"""The server's process around its engines: what start-up made is kept out of the collector's scans
while it serves, and handed back when it stops."""

from __future__ import annotations

import gc

import httpx

from tests.serving import MODEL, start_server


def test_start_up_objects_are_frozen_while_serving_and_thawed_after(smollm):
    assert gc.get_freeze_count() == 0
    server = start_server(smollm)
    try:
        # The model, torch and the app: far more than any request makes, none of it scanned again.
        frozen = gc.get_freeze_count()
        assert frozen > 50_000, frozen
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
        assert gc.get_freeze_count() <= frozen  # requests' objects stay collectable (frozen ones may be freed)
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0
