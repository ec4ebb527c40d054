"""The agents' model turns through the server's own chat-completions path: routing, templates, tool
grammars and sampling defaults are those of `/v1/chat/completions`, with no HTTP in between."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Message

from wafer.errors import APIError, server_error

Answer = Callable[[str, Any, Request], Awaitable[Response]]
INTERRUPTED = "interrupted"  # the finish reason of a turn that the server's shutdown cut


def in_process_request(body: dict[str, Any], path: str = "/v1/chat/completions", tenant: str | None = None) -> Request:
    """A request as the handlers read it: the body, then no disconnect until cancelled (the agent's
    own request, or a batch's task, owns the work and cancels it). `tenant`: request.state.tenant,
    whose the work is."""
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b"",
             "state": {"tenant": tenant}}
    return Request(scope, receive)


def _error(status: int, payload: Any) -> APIError:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return APIError(status, err["message"], err.get("type") or "server_error", err.get("param"), err.get("code"))
    return server_error(f"The model's backend answered {status}: {str(payload)[:200]}")


class InProcessChat:
    """`wafer.agents.backend.CheckedBackend` over the app's `answer`."""

    def __init__(self, answer: Answer, check_model: Callable[[str], None],
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.answer = answer
        self.check_model = check_model  # raises the 404 for a name that no model or upstream answers to
        # Whether the server is shutting down: its last chunks say "length" for a sequence it cut
        # (as OpenAI's clients expect), which to an agent is "interrupted", not a spent budget.
        self.draining = draining

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        response = await self.answer("chat", body, in_process_request(body))
        iterator = getattr(response, "body_iterator", None)
        if iterator is None:  # a JSON reply to a streamed request is an error (an upstream's, say)
            raw = bytes(response.body)
            raise _error(response.status_code, json.loads(raw) if raw else None)
        buffer = ""
        try:
            async for piece in iterator:
                buffer += piece if isinstance(piece, str) else piece.decode()
                *events, buffer = buffer.split("\n\n")
                for event in events:
                    data = "".join(line[5:].strip() for line in event.split("\n") if line.startswith("data:"))
                    if not data:
                        continue  # a ping
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise _error(500, chunk)
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason") == "length" and self.draining():
                            choice["finish_reason"] = INTERRUPTED
                    yield chunk
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                await close()  # aborts the sequences of a turn left early
