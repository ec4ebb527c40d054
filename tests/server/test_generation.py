"""The pre-rendered events of the streaming path are byte for byte what serialising the whole
chunk gives; heavy preparation runs off the loop."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from wafer.engine.async_engine import SIDE_WORK
from wafer.server.generation import TEXT_HOLE, off_loop, sse, text_event


@pytest.mark.parametrize("text", ["", "Hello", ' "quoted" \\ back', "line\nbreak\ttab", "é 中文 🙂", "\x00\x1f",
                                  TEXT_HOLE, "}]}\n\ndata: [DONE]"])
def test_text_event_matches_whole_serialisation(text):
    def chunk(value):
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": value}, "logprobs": None, "finish_reason": None}],
                "usage": None}

    line = text_event(chunk(TEXT_HOLE))(text)
    assert line == sse(chunk(text))
    assert json.loads(line.removeprefix("data: "))["choices"][0]["delta"]["content"] == text


def test_heavy_preparation_runs_off_the_loop_as_side_work():
    """A heavy request's preparation runs on another thread, counted as side work (the engine's steps
    leave it a core meanwhile); a light one runs on the loop, uncounted."""
    def where() -> tuple[int, int]:
        return threading.get_ident(), SIDE_WORK.active

    async def main() -> tuple[int, tuple[int, int], tuple[int, int]]:
        return threading.get_ident(), await off_loop(True, where), await off_loop(False, where)

    loop_thread, heavy, light = asyncio.run(main())
    assert heavy[0] != loop_thread and heavy[1] == 1
    assert light == (loop_thread, 0)
    assert SIDE_WORK.active == 0
