"""OpenAI-shaped errors: every failure leaves as {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wafer.errors import APIError, bad_request, server_error

__all__ = ["APIError", "CatchAll", "bad_request", "error_response", "new_request_id", "server_error"]

log = logging.getLogger("wafer.server")


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def error_response(e: APIError) -> JSONResponse:
    """The error as a reply. A 500 always carries a request id, in its message and its
    `x-request-id` header, that the server's log names too: a 500 made without one gets one here."""
    headers = dict(e.headers)
    message = e.message
    if e.status == 500 and "x-request-id" not in {k.lower() for k in headers}:
        rid = new_request_id()
        headers["x-request-id"] = rid
        message = f"{message.rstrip('.')} (request id {rid})."
        log.error("request %s answered 500: %s", rid, e.message)
    body = APIError(e.status, message, e.type, e.param, e.code).body()
    return JSONResponse(body, status_code=e.status, headers=headers)


class CatchAll:
    """An unexpected exception becomes a 500 in the OpenAI shape, and the connection stays usable.
    Starlette's own last-resort handler sends its reply and then re-raises, which makes the server
    close a keep-alive connection that the client believes is still open; its next request fails."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:  # a streamed reply already under way: only closing the connection can end it
                raise
            rid = new_request_id()
            log.exception("request %s: unhandled error on %s %s", rid, scope.get("method"), scope.get("path"))
            await error_response(server_error("Internal server error.", rid))(scope, receive, send)
