"""`wafer serve` as a process: its startup line, and a graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.serving import MODEL, free_port, wait_healthy
from wafer.cli import build_parser


def start_serve(*args: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`wafer serve ARGS` on a free port: the process, its base URL, and its output lines as they come."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "wafer.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, f"http://127.0.0.1:{port}", lines


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)


def test_sigterm_drains_then_exits_zero():
    proc, base, lines = start_serve("--max-running", "4", "--shutdown-grace", "3", "--served-model-name", MODEL,
                                    "--served-model-name", "smol")
    try:
        wait_healthy(base, 120)
        startup = "".join(lines)
        assert f"{base}/v1" in startup and MODEL in startup and "smol" in startup
        ids = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
        assert ids[0] == MODEL and "smol" in ids and "gpt-5.6" in ids

        results: dict[str, list[str]] = {"short": [], "long": []}

        def stream(name: str, max_tokens: int) -> None:
            body = {"model": "smol", "messages": [{"role": "user", "content": "Tell a story."}],
                    "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        results[name].append(line[6:])

        short = threading.Thread(target=stream, args=("short", 40))
        long = threading.Thread(target=stream, args=("long", 3000))
        short.start()
        long.start()
        while len(results["long"]) < 3:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(base + "/v1/chat/completions", json={"model": "smol", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        short.join(60)
        long.join(60)
        assert proc.wait(60) == 0
    finally:
        stop(proc)

    for name, expected_reason in (("short", "length"), ("long", "length")):
        events = results[name]
        assert events[-1] == "[DONE]", name
        chunks = [json.loads(e) for e in events[:-1]]
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == expected_reason
    # The short request finished in the grace period with all its tokens; the long one was cut.
    short_text = sum(1 for e in results["short"][:-1] if json.loads(e)["choices"][0]["delta"].get("content"))
    assert short_text >= 30
    assert len(results["long"]) < 3000


def test_requests_never_started_get_503_not_an_empty_answer():
    """At the end of the grace period, a queued request that never produced a token is answered 503
    (with Retry-After), not 200 with empty content and no tokens, which a client would take for an
    answer; the running one ends with what it has, finish_reason "length"."""
    proc, base, _ = start_serve("--max-running", "1", "--shutdown-grace", "1", "--served-model-name", MODEL)
    results: dict[str, httpx.Response] = {}

    def ask(name: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 3000,
                "ignore_eos": True}
        results[name] = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)

    try:
        wait_healthy(base, 120)
        running = threading.Thread(target=ask, args=("running",))
        running.start()
        time.sleep(0.5)  # the first is decoding (one sequence at a time), the second will wait
        queued = threading.Thread(target=ask, args=("queued",))
        queued.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        running.join(60)
        queued.join(60)
        assert proc.wait(60) == 0
    finally:
        stop(proc)
    r = results["running"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert 0 < r.json()["usage"]["completion_tokens"] < 3000
    q = results["queued"]
    assert q.status_code == 503 and q.headers["retry-after"] == "5", q.text
    assert q.json()["error"]["code"] == "unavailable"


def test_an_idle_connection_is_kept_longer_than_clients_keep_theirs():
    """uvicorn's own 5 s closed connections that clients' pools (aiohttp 15 s, Go 90 s) still held,
    and a request sent on one as it closed was lost: `wafer serve` keeps them 120 s by default."""
    import http.client

    assert build_parser().parse_args(["serve"]).keep_alive == 120.0
    proc, base, _ = start_serve("--served-model-name", MODEL)
    try:
        wait_healthy(base, 120)
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock.getsockname()
        time.sleep(6)  # past uvicorn's default
        conn.request("GET", "/health")  # on the same connection: the server has not closed it
        r = conn.getresponse()
        assert r.status == 200 and r.read()
        assert conn.sock.getsockname() == first
        conn.close()
    finally:
        stop(proc)
