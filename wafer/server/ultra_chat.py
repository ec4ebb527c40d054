"""Ultra by its model name on `/v1/chat/completions`: the conversation becomes a Responses request
(store off) that the agents' service makes, and its result a chat completion: the synthesis as the
message's `content`, the plan and the sub-agents' work as its `reasoning_content` (as a thinking
model's reasoning comes on chat), each agent's part headed with its name.

What needs the Responses API's items (the client's tools, tool turns, several choices, logprobs) is
refused with a 400 that says to use `/v1/responses`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from wafer.agents.items import ResponseRequest
from wafer.agents.responses import ResponsesService
from wafer.errors import APIError, bad_request
from wafer.server.generation import sse, unless_disconnect
from wafer.server.protocol import ChatCompletionRequest, parse_body
from wafer.server.streaming import EventStreamResponse

ULTRA = "-ultra"
ELSEWHERE = "use /v1/responses, where Ultra takes them"


def _request(req: ChatCompletionRequest, body: dict[str, Any]) -> ResponseRequest:
    """The Responses request that the chat request stands for; a 400 for what only items can say."""
    if req.tools or (req.tool_choice not in (None, "none", "auto")):
        raise bad_request(f"Ultra on /v1/chat/completions takes no tools: {ELSEWHERE}.", "tools")
    if req.n != 1:
        raise bad_request(f"Ultra on /v1/chat/completions makes one choice (n = 1): {ELSEWHERE}.", "n")
    if req.logprobs:
        raise bad_request("Ultra on /v1/chat/completions gives no logprobs.", "logprobs")
    items = []
    for i, m in enumerate(req.messages):
        if m.role == "tool" or m.tool_calls:
            raise bad_request(f"Ultra on /v1/chat/completions takes no tool calls or tool messages: {ELSEWHERE}.",
                              f"messages[{i}]")
        try:
            text = m.text()
        except ValueError as e:
            raise bad_request(str(e), f"messages[{i}].content") from None
        items.append({"type": "message", "role": m.role, "content": text})
    fields: dict[str, Any] = {"model": req.model, "input": items, "store": False,
                              "max_output_tokens": req.output_limit, "temperature": req.temperature,
                              "top_p": req.top_p, "seed": req.seed, "user": req.user, "metadata": req.metadata,
                              "multi_agent": body.get("multi_agent")}  # wafer's, passed on as /v1/responses takes it
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        fields["text"] = {"format": {"type": "json_object"}}
    elif fmt is not None and fmt.type == "json_schema":
        js = fmt.json_schema
        fields["text"] = {"format": {"type": "json_schema", "name": js.name, "schema": js.schema_,
                                     "strict": js.strict}}
    return parse_body(ResponseRequest, {k: v for k, v in fields.items() if v is not None})


def _usage(response: dict[str, Any]) -> dict[str, Any]:
    u = response.get("usage") or {}
    reasoning = (u.get("output_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"prompt_tokens": u.get("input_tokens", 0), "completion_tokens": u.get("output_tokens", 0),
            "total_tokens": u.get("total_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": (u.get("input_tokens_details") or {}).get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": reasoning, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


def _finish(response: dict[str, Any]) -> str:
    return "length" if response.get("status") == "incomplete" else "stop"


class _Reasoning:
    """The agents' work as one text: each agent's run of deltas headed with its name when it changes."""

    def __init__(self) -> None:
        self.agent: str | None = None
        self.text = ""

    def add(self, agent: str, delta: str) -> str:
        piece = delta
        if agent != self.agent:
            piece = f"{chr(10) * 2 if self.text else ''}[{agent}] {delta}"
            self.agent = agent
        self.text += piece
        return piece


async def ultra_chat(service: ResponsesService, body: dict[str, Any], request: Request) -> Response:
    req = parse_body(ChatCompletionRequest, body)
    plan = await service.plan(_request(req, body), getattr(request.state, "tenant", None))
    rid = f"chatcmpl-{secrets.token_hex(16)}"
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model}
    headers = {"x-request-id": rid, "x-wafer-model": req.model}

    def deltas(event: dict[str, Any], thoughts: _Reasoning) -> dict[str, Any] | None:
        kind = event["type"]
        if kind == "response.reasoning_text.delta":
            return {"reasoning_content": thoughts.add(event.get("agent", "root"), event["delta"])}
        if kind == "response.output_text.delta" and event.get("agent", "root") == "root":
            return {"content": event["delta"]}
        return None

    if req.stream:
        async def chunks() -> AsyncIterator[str]:
            thoughts = _Reasoning()
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
            final: dict[str, Any] = {}
            async for event in service.run(plan):
                if event["type"] == "error":  # response.failed follows: the chat stream ends here
                    code = event.get("code")
                    kind = "server_error" if code in (None, "internal_error", "server_error") else \
                        "invalid_request_error"
                    yield sse(APIError(500, event["message"], kind, event.get("param"), code).body())
                    return
                delta = deltas(event, thoughts)
                if delta is not None:
                    yield sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": None}]})
                final = event.get("response", final)
            yield sse({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                            "finish_reason": _finish(final)}]})
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(final)})
            yield "data: [DONE]\n\n"

        return EventStreamResponse(chunks(), headers=headers)

    thoughts = _Reasoning()
    answer: list[str] = []
    final: dict[str, Any] = {}

    async def consume() -> None:
        async for event in service.run(plan):
            delta = deltas(event, thoughts)
            if delta is not None and "content" in delta:
                answer.append(delta["content"])
            final["response"] = event.get("response", final.get("response"))

    if not await unless_disconnect(consume(), request):
        return JSONResponse({}, status_code=499)
    if plan.failure is not None:
        raise plan.failure
    message: dict[str, Any] = {"role": "assistant", "content": "".join(answer), "refusal": None}
    if thoughts.text:
        message["reasoning_content"] = thoughts.text
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": head["created"], "model": req.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(final["response"])}],
        "usage": _usage(final["response"]),
    }, headers=headers)
