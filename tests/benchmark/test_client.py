"""`wafer bench`'s client reads a stream as SSE allows it to come: events split across reads,
CRLF line ends, comments, an error event mid-stream."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from wafer.benchmark.client import send
from wafer.benchmark.workload import Prompt


def _chunk(content: str) -> str:
    return json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]})


def _send(pieces: list[bytes]):
    """`send` against a loopback server that writes `pieces` one by one, each its own TCP write."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for p in pieces:
            await resp.write(p)
            await asyncio.sleep(0.002)  # apart, so that the client reads them apart
        await resp.write_eof()
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                return await send(session, f"http://127.0.0.1:{port}/v1", "chat", "m", Prompt("hi", None, 8), None,
                                  True, 30.0)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_events_split_across_reads_with_crlf_and_comments():
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    stream = (f"data: {_chunk('')}\r\n\r\n: ping\r\n\r\ndata: {_chunk('Hel')}\r\n\r\n"
              f"data: {_chunk('lo')}\r\n\r\ndata: {usage}\r\n\r\ndata: [DONE]\r\n\r\n").encode()
    # cut into reads that end inside events, inside a CRLF pair and inside the JSON
    pieces = [stream[i:i + 7] for i in range(0, len(stream), 7)]
    rec = _send(pieces)
    assert rec.ok and rec.status == 200
    assert rec.text == "Hello" and len(rec.chunk_times) == 2  # the empty role chunk is not a token
    assert (rec.usage_prompt, rec.usage_completion) == (3, 2)
    assert rec.end == rec.chunk_times[-1]


def test_error_event_mid_stream_ends_the_record():
    error = json.dumps({"error": {"message": "engine failed", "type": "server_error", "param": None, "code": None}})
    rec = _send([f"data: {_chunk('a')}\n\n".encode(), f"data: {error}\n\n".encode(),
                 f"data: {_chunk('never')}\n\n".encode()])
    assert not rec.ok
    assert (rec.error_type, rec.error) == ("server_error", "engine failed")
    assert rec.text == "a"


def test_refused_connection_is_an_error_record():
    from tests.serving import free_port

    async def go():
        async with aiohttp.ClientSession() as session:
            return await send(session, f"http://127.0.0.1:{free_port()}/v1", "chat", "m", Prompt("hi", None, 8), None,
                              True, 10.0)

    rec = asyncio.run(go())
    assert not rec.ok and rec.status == 0
    assert rec.error_type == "ClientConnectorError" and rec.end is not None
