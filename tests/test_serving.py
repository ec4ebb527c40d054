"""The suite's own waits (tests/serving.py) fail loudly when what they wait for never comes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.serving import RunningServer, free_port, wait_healthy


def test_wait_healthy_raises_when_nothing_listens():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not 200 after 0.5 s"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", 0.5)
    assert time.monotonic() - t0 < 5


def test_wait_healthy_raises_on_a_server_that_stays_unhealthy():
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "loading"}, status_code=503)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with pytest.raises(TimeoutError, match="503"):
            wait_healthy(f"http://127.0.0.1:{port}", 2)
    finally:
        server.should_exit = True
        thread.join(10)


def test_wait_idle_raises_when_the_engine_stays_busy():
    busy = SimpleNamespace(idle=False, num_running=1, num_waiting=2)
    s = RunningServer("http://unused", SimpleNamespace(engine=busy), None, None)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="1 running, 2 waiting"):
        s.wait_idle(0.2)
    busy.idle = True
    s.wait_idle(0.2)
