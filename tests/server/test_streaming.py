"""EventStreamResponse on its own, as an ASGI app: events in order, then the end; a client gone
mid-stream stops a body that always has its next event ready, and runs the body's cleanup."""

from __future__ import annotations

import asyncio

import pytest

from wafer.server.streaming import EventStreamResponse


def run(response: EventStreamResponse, disconnect_after: float | None) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        if disconnect_after is None:
            await asyncio.Event().wait()  # the client stays
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=10)

    asyncio.run(main())
    return sent


def test_events_in_order_then_the_end():
    async def body():
        for i in range(3):
            yield f"data: {i}\n\n"

    sent = run(EventStreamResponse(body()), None)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and headers[b"cache-control"] == b"no-cache"
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]


def test_a_disconnect_stops_a_body_that_is_never_idle():
    cleaned = []

    async def body():
        try:
            while True:
                await asyncio.sleep(0)  # a wake-up always due, like a token every engine step
                yield "data: x\n\n"
        finally:
            cleaned.append(True)

    sent = run(EventStreamResponse(body()), 0.05)
    assert cleaned == [True]
    assert len(sent) > 2 and all(m["more_body"] for m in sent[1:])  # never claims a normal end


def test_an_error_in_the_body_is_raised():
    async def body():
        yield "data: 1\n\n"
        raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        run(EventStreamResponse(body()), None)
