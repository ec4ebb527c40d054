"""The pre-rendered events of the streaming path are byte for byte what serialising the whole
chunk gives."""

from __future__ import annotations

import json

import pytest

from wafer.server.generation import TEXT_HOLE, sse, text_event


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
