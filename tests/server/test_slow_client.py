"""A client that reads its stream slowly holds back no one: the engine keeps generating for it and
for the others, the server's socket buffer for it stays at the transport's high-water mark, and
when it reads at last it gets the whole stream intact."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

from tests.serving import MODEL


def test_a_client_that_does_not_read_delays_no_other(server, client):
    u = urlparse(server.base_url)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                       "max_tokens": 120, "ignore_eos": True, "stream": True, "temperature": 0,
                       # ~3 KB an event: far more than the socket buffers hold, so the server must hold back
                       "logprobs": True, "top_logprobs": 20}).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few dozen events
    slow.connect((u.hostname, u.port))
    slow.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    try:
        engine = server.engine
        deadline = time.monotonic() + 60
        while engine.num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Another client, streaming, is served to the end while the slow one reads nothing.
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=40, stream=True, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 30
        server.wait_idle(120)  # the slow client's 120 tokens were all generated: nothing waited on its socket
        assert engine.num_running == 0 and engine.blocks.num_used == 0
        # Now it reads: every event is there, in order, ending with [DONE].
        slow.settimeout(30)
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
            got = slow.recv(65536)
            if not got:  # closed once idle past keep-alive: all that was sent has been read
                break
            raw += got
    finally:
        slow.close()
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 115
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
