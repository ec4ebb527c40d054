"""The OpenAPI document at /openapi.json, describing what the server really parses and sends.

The POST endpoints read their bodies by hand (to give OpenAI-shaped 400s rather than FastAPI's 422),
so FastAPI sees no body to describe: the request models are added here from the same pydantic
classes that parse them, with every error status the endpoints send in the OpenAI error shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from wafer.server.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_WHY = {
    "400": "The request is malformed or names an invalid value (`param` says which).",
    "401": "No API key, or a wrong one.",
    "404": "No such model (or file, or batch: another tenant's is not found either).",
    "409": "The batch has ended and cannot be cancelled.",
    "413": "The body (or the uploaded file) is larger than the server accepts.",
    "429": "Too many requests are waiting; retry after `Retry-After` seconds.",
    "500": "The server failed while answering.",
    "503": "The server is shutting down, or no upstream could answer; retry after `Retry-After` seconds.",
}
_BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def _error_responses(codes: list[str]) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model="ErrorResponse")}
    return {c: {"description": _WHY[c], "content": {"application/json": {"schema": ref}}} for c in codes}


def install_openapi(app: FastAPI, secured: bool) -> None:
    """Replace the app's OpenAPI generator with one that adds the request bodies and error replies.
    `secured`: the /v1 endpoints take a bearer key."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, top = models_json_schema([(m, "validation") for m in _BODIES.values()], ref_template=_REF)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(top.get("$defs", {}))
        schemas["ErrorResponse"] = _ERROR
        # FastAPI lists a 422 for path parameters; this server never sends one (a bad value is a 400).
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if secured:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                codes = ["500"]
                if path.startswith("/v1/"):
                    codes += ["401"] if secured else []
                    if secured:
                        op["security"] = [{"bearer": []}]
                if "{model_id" in path:
                    codes.append("404")
                if path.startswith(("/v1/files", "/v1/batches")):  # the Batch API (batch_routes.py)
                    codes += ["400", "404"] + (["413"] if path == "/v1/files" and method == "post" else []) + (
                        ["409"] if path.endswith("/cancel") else [])
                model = _BODIES.get(path) if method == "post" else None
                if model is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": _REF.format(model=model.__name__)}}}}
                    codes += ["400", "404", "413", "429", "503"]
                responses.update(_error_responses(sorted(set(codes))))
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]
