"""A chat model whose turns the test writes: what the Responses layer sends it is kept for the test
to read, and each turn answers with the next text or tool calls of the script."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Union

# a text answer; calls: (function name, arguments); or {"reasoning": ..., "text": ...} (a thinking model's)
Turn = Union[str, list[tuple[str, dict[str, Any]]], dict[str, str]]


def words(text: str) -> int:
    """A stand-in token count: what a scripted turn 'reads' and 'writes'."""
    return len(text.split())


@dataclass
class ScriptedChat:
    turns: list[Turn | Callable[[dict[str, Any]], Turn]]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    # When set, every turn is policy(body) (turns of agents running at once come in any order);
    # an async policy may wait, to hold its turn open.
    policy: Callable[[dict[str, Any]], Any] | None = None

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.bodies.append(body)
        if self.policy is not None:
            turn = self.policy(body)
            if hasattr(turn, "__await__"):
                turn = await turn
        else:
            if not self.turns:
                raise AssertionError("the script has no turn left")
            turn = self.turns.pop(0)
            if callable(turn):
                turn = turn(body)
        head = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body["model"]}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        thought = ""
        if isinstance(turn, dict):
            thought = turn["reasoning"]
            for k, piece in enumerate(thought.split(" ")):
                yield chunk({"reasoning_content": piece if k == 0 else " " + piece})
            turn = turn["text"]
        if isinstance(turn, str):
            for k, piece in enumerate(turn.split(" ")):
                yield chunk({"content": piece if k == 0 else " " + piece})
            out, finish = turn, "stop"
        else:
            for k, (name, args) in enumerate(turn):
                yield chunk({"tool_calls": [{"index": k, "id": f"call_s{len(self.bodies)}_{k}", "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(args)}}]})
            out, finish = json.dumps(turn), "tool_calls"
        yield chunk({}, finish)
        read = words(json.dumps(body["messages"]))
        wrote = words(out) + words(thought)
        yield {**head, "choices": [], "usage": {"prompt_tokens": read, "completion_tokens": wrote,
                                                "total_tokens": read + wrote,
                                                "completion_tokens_details": {"reasoning_tokens": words(thought)}}}
