"""The server's process around its engines: what start-up made is kept out of the collector's scans
while it serves, and handed back when the last server of the process stops."""

from __future__ import annotations

import gc

import httpx

from tests.serving import MODEL, start_server
from wafer.server.main import FROZEN


def test_start_up_objects_are_frozen_while_serving_and_thawed_after(smollm):
    others = FROZEN.servers  # the session's shared server may be running in this process
    server = start_server(smollm)
    try:
        # The model, torch and the app: far more than any request makes, none of it scanned again.
        assert FROZEN.servers == others + 1
        frozen = gc.get_freeze_count()
        assert frozen > 50_000, frozen
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
        assert gc.get_freeze_count() <= frozen  # requests' objects stay collectable (frozen ones may be freed)
    finally:
        server.stop()
    assert FROZEN.servers == others
    assert (gc.get_freeze_count() == 0) == (others == 0)  # thawed by the last server to stop
