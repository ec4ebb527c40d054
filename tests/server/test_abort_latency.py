"""A client that goes away stops its sequences at once: within a step or two of the server learning
of it, not after the several turns of the loop that cancelling its writer takes."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import pytest

from tests.serving import MODEL


def _open_stream(base_url: str, path: str, body: bytes) -> socket.socket:
    u = urlparse(base_url)
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    return s


def _steps_after_closing(server, streamed: bool, clients: int = 12) -> int:
    import json

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 400, "ignore_eos": True, "stream": streamed}).encode()
    socks = [_open_stream(server.base_url, "/v1/chat/completions", body) for _ in range(clients)]
    engine = server.engine
    deadline = time.monotonic() + 60
    while engine.num_running < clients:  # every request decoding
        assert time.monotonic() < deadline, "the requests never all ran"
        time.sleep(0.01)
    time.sleep(0.2)
    for s in socks:  # all at once, as a client's pool would on shutdown
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST: no read-back
        s.close()
    closed_at = engine.stats.steps
    server.wait_idle()
    assert engine.num_running == 0 and engine.blocks.num_used == 0
    return engine.stats.steps - closed_at


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "not-streamed"])
def test_disconnected_clients_stop_within_two_steps(server, streamed):
    server.wait_idle()
    steps = _steps_after_closing(server, streamed)
    # One step may be under way when the sockets close, and the next may start before the loop reads
    # the disconnects; a third is the abort arriving late.
    assert steps <= 2, f"{steps} steps ran after every client had gone"
