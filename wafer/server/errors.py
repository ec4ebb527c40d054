"""OpenAI-shaped errors: every failure leaves as {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wafer.errors import APIError, bad_request, server_error

__all__ = ["APIError", "CatchAll", "bad_request", "error_response", "server_error"]

log = logging.getLogger("wafer.server")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await error_response(server_error("Internal server error."))(scope, receive, send)
