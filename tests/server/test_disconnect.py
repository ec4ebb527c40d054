"""Clients that go away: their sequences are aborted and their KV cache slots come back."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.serving import MODEL

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0}


def wait_for(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_twenty_streaming_clients_drop(server):
    got_chunks = []

    def client():
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", server.base_url + "/v1/chat/completions", json={**LONG, "stream": True}) as r:
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        n += 1
                    if n >= 4:
                        break
                got_chunks.append(n)
        # leaving the with-blocks closes the connection mid-stream

    threads = [threading.Thread(target=client) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(got_chunks) == 20 and all(n >= 4 for n in got_chunks)
    engine = server.engine
    # 1500 tokens each would take minutes; aborted, everything is free almost at once.
    assert wait_for(lambda: engine.num_running == 0 and engine.num_waiting == 0 and server.served.engine.idle)
    assert engine.blocks.num_used == 0 and engine.blocks.usage == 0.0
    assert engine.seqs == {}


def test_non_streaming_client_drops(server):
    """The request runs (its sequence generates and holds KV), the client goes away, and the sequence
    is aborted long before its 1500 tokens and its KV comes back."""
    engine = server.engine
    before = set(engine.seqs)
    body = json.dumps(LONG).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def ours():  # the request's sequence once it is in the engine (read from the server's thread)
        return next((s for i, s in list(engine.seqs.items()) if i not in before), None)

    try:
        assert wait_for(lambda: (s := ours()) is not None and len(s.output_ids) >= 8, 60), "it never generated"
        seq = ours()
        assert engine.blocks.num_used > 0  # its KV is held while it runs
    finally:
        sock.close()  # the client goes away without reading an answer
    assert wait_for(lambda: seq.finished and server.served.engine.idle, 10)
    assert seq.finish_reason == "abort" and len(seq.output_ids) < LONG["max_tokens"], (seq.finish_reason,
                                                                                         len(seq.output_ids))
    assert seq.seq_id not in engine.seqs and engine.blocks.num_used == 0
    ok = httpx.post(server.base_url + "/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
