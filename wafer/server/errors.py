"""OpenAI-shaped errors: every failure leaves as {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("wafer.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


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
            await server_error("Internal server error.").response()(scope, receive, send)
