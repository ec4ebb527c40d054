"""Errors that users see: each names what is wrong and where."""

from __future__ import annotations

from typing import Any


class WaferError(Exception):
    """Base for errors whose message is meant for the user as it is."""


class ModelLoadError(WaferError):
    """A model file or directory is missing, corrupt or of an unsupported kind."""


class APIError(WaferError):
    """A request that fails with an HTTP status and an OpenAI-shaped body. Raised by every layer that
    answers requests (server, agents); the server turns it into the response."""

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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def server_error(message: str, request_id: str | None = None) -> APIError:
    """A 500. With `request_id` (what the server's log names the failure by), the message ends with
    it and the `x-request-id` header carries it, as OpenAI's do; without one, the server's error
    handler gives it one."""
    if request_id is None:
        return APIError(500, message, "server_error", None, "internal_error")
    return APIError(500, f"{message.rstrip('.')} (request id {request_id}).", "server_error", None,
                    "internal_error", {"x-request-id": request_id})
