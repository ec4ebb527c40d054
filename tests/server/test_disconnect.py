"""Clients that go away: their sequences are aborted and their KV cache slots come back."""

from __future__ import annotations

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
    assert engine.kv.num_used == 0 and engine.kv.usage == 0.0
    assert engine.seqs == {}


def test_non_streaming_client_drops(server):
    try:
        httpx.post(server.base_url + "/v1/chat/completions", json=LONG, timeout=1.5)
    except httpx.TimeoutException:
        pass
    engine = server.engine
    assert wait_for(lambda: engine.num_running == 0 and server.served.engine.idle, 10)
    assert engine.kv.num_used == 0
    ok = httpx.post(server.base_url + "/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
