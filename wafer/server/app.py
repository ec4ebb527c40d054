"""The FastAPI application: routes, authentication, body limits, and OpenAI-shaped errors."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from importlib.resources import files

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from wafer.server.errors import APIError, server_error
from wafer.server.metrics import ServerMetrics, StatusCounter
from wafer.server.chat import ChatHandler
from wafer.server.completions import CompletionHandler
from wafer.server.generation import ServedModel
from wafer.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body

log = logging.getLogger("wafer.server")

MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyLimit:
    """413 for a body over the limit, whether it declares its length or streams it in chunks."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = APIError(413, f"Request body too large (limit {self.limit} bytes).", "invalid_request_error",
                           None, "request_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_big.response()(scope, receive, send)
            return
        # Read the whole body here (it is small by definition), then replay it to the app.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message), send)
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await too_big.response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)


def _replay(chunks: list[bytes], final: Message | None, receive: Receive | None = None) -> Receive:
    """A receive() that hands out a body already read, then defers to the real one (which is
    how the app later learns of a disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    if final is not None:
        pending = [final]

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        if receive is None:
            return {"type": "http.disconnect"}
        return await receive()

    return replayed


def create_app(served: ServedModel, api_keys: list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="wafer", docs_url=None, redoc_url=None)
    if served.metrics is None:
        served.metrics = ServerMetrics(served.names[0], served.engine)
    metrics = served.metrics
    chat_handler = ChatHandler(served)
    completion_handler = CompletionHandler(served)
    static = files("wafer.server") / "static"
    keys = list(api_keys or [])
    app.state.served = served

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), "invalid_request_error", None, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return server_error("Internal server error.").response()

    async def authorize(request: Request) -> None:
        """Bearer keys, when the server has any (a dependency, not middleware: Starlette's
        BaseHTTPMiddleware would hide client disconnects from the handlers)."""
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           "invalid_request_error", None, "invalid_api_key")
        if scheme.lower() != "bearer" or not any(secrets.compare_digest(token.strip(), k) for k in keys):
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e.msg if hasattr(e, 'msg') else e}).",
                           "invalid_request_error", None, "invalid_json") from None

    def check_model(name: str) -> None:
        if name not in served.names:
            raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                           "invalid_request_error", "model", "model_not_found")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": served.created, "owned_by": "wafer",
                "max_model_len": served.max_model_len}

    @app.get("/health")
    async def health() -> Response:
        ok = served.engine.accepting
        return JSONResponse({"status": "ok" if ok else "draining", "running": served.engine.num_running,
                             "waiting": served.engine.num_waiting}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response((static / "dashboard.html").read_text(), media_type="text/html")

    @app.get("/dashboard.js")
    async def dashboard_js() -> Response:
        return Response((static / "dashboard.js").read_text(), media_type="application/javascript")

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict[str, Any]:
        return metrics.snapshot()

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in served.names]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card(model_id)

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        return await chat_handler.chat(req, request)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_json(request))
        check_model(req.model)
        return await completion_handler.completions(req, request)

    app.include_router(v1)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(StatusCounter, metrics=metrics)
    return app
