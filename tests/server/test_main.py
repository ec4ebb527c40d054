"""The server's process around its engines: what start-up made is kept out of the collector's scans
and the GIL changes hands sooner while it serves, both handed back when the last server of the
process stops."""

from __future__ import annotations

import gc
import sys

import httpx

from tests.serving import MODEL, start_server
from wafer.server.main import SERVING


def test_start_up_objects_frozen_and_gil_handed_over_sooner_while_serving_then_as_before(smollm):
    others = SERVING.servers  # the session's shared server may be running in this process
    interval = sys.getswitchinterval()
    server = start_server(smollm)
    try:
        # The model, torch and the app: far more than any request makes, none of it scanned again.
        assert SERVING.servers == others + 1
        assert sys.getswitchinterval() == SERVING.SWITCH_INTERVAL
        frozen = gc.get_freeze_count()
        assert frozen > 50_000, frozen
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
        assert gc.get_freeze_count() <= frozen  # requests' objects stay collectable (frozen ones may be freed)
    finally:
        server.stop()
    assert SERVING.servers == others
    assert (gc.get_freeze_count() == 0) == (others == 0)  # thawed by the last server to stop
    assert sys.getswitchinterval() == interval  # Python's own again once the last server stops
