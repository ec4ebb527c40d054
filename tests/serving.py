"""A real wafer server on a free loopback port, in this process so tests can look inside it, or in a
process of its own (serve_process)."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import httpx
import uvicorn

from wafer.config import CacheSettings, EngineSettings
from wafer.engine.compute_threads import release_compute_threads
from wafer.server.app import create_app
from wafer.server.generation import ServedModel
from wafer.server.main import EngineServer, build_served

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class RunningServer:
    base_url: str
    served: ServedModel
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self):  # the LLMEngine inside
        return self.served.engine.engine

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has nothing running or waiting; raises if it still has after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.served.engine.idle:
            if time.monotonic() >= deadline:
                e = self.served.engine
                raise TimeoutError(f"engine not idle after {timeout:g} s: {e.num_running} running, "
                                   f"{e.num_waiting} waiting")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(loaded, api_keys=None, max_running=16, max_waiting=64, names=None, engine_kw=None,
                 **app_kw) -> RunningServer:
    kw = dict(engine_kw or {})
    cache = CacheSettings(**{k: kw.pop(k) for k in [f.name for f in fields(CacheSettings)] if k in kw})
    settings = EngineSettings(max_running=max_running, max_waiting=max_waiting, max_model_len=2048)
    served = build_served(loaded, names or [MODEL], settings, cache, **kw)
    return serve_app(create_app(served, api_keys, **app_kw), served)


def serve_app(app, served: ServedModel, *others: ServedModel) -> RunningServer:
    """Run an app on a free loopback port in a thread, its loop stepping the engines of `served` and
    `others`, as `wafer serve` does; returns once /health answers."""
    port = free_port()
    server = EngineServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), [served, *others])
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    release_compute_threads()  # the server's thread computes now (see there)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 30)
    return RunningServer(base, served, server, thread)


def wait_healthy(base: str, timeout: float) -> None:
    """Until GET /health answers 200; raises if it has not after `timeout`."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base + "/health", timeout=1)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.1)
    raise TimeoutError(f"{base}/health not 200 after {timeout:g} s; last: {last}")


@contextmanager
def serve_process(argv: list[str], port: int, log: Path, timeout: float,
                  **popen: object) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (`wafer serve`, `make serve`) that listens on `port`, its output in `log`,
    from when /health answers until the block ends (the block gets the process), then stopped with
    SIGTERM as an operator stops it (killed if it has not ended 60 s later). Raises AssertionError
    with the log's end if /health has not answered after `timeout` seconds."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", timeout)
        except TimeoutError:
            raise AssertionError(f"`{shlex.join(argv)}` did not come up:\n{log.read_text()[-3000:]}") from None
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
