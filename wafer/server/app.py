"""The FastAPI application: routes, authentication, body limits, and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
import re
import secrets
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wafer import untrusted_json
from wafer.agents.items import ResponseRequest
from wafer.agents.responses import ResponsesService, sse
from wafer.agents.store import ResponseStore
from wafer.router.config import ROUTER_NAMES, TIER_ALIASES, LocalModelConfig, UpstreamConfig, default_config
from wafer.router.router import Router, UnknownModel
from wafer.router.replicas import ReplicaSet
from wafer.router.upstream import UpstreamUnavailable, forward
from wafer.server.chat import ChatHandler
from wafer.server.completions import CompletionHandler
from wafer.server.errors import APIError, CatchAll, error_response
from wafer.server.generation import OFF_LOOP_BYTES, ServedModel, off_loop, unless_disconnect
from wafer.server.in_process import InProcessChat
from wafer.server.metrics import ServerMetrics, StatusCounter
from wafer.server.loop_monitor import LoopMonitor
from wafer.server.openapi import install_openapi
from wafer.server.streaming import EventStreamResponse
from wafer.server.ultra_chat import ULTRA, ultra_chat
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
        # Too many digits for any body (and for int(), past 4,300) is over the limit too.
        if declared is not None and declared.isdigit() and (len(declared) > 18 or int(declared) > self.limit):
            await error_response(too_big)(scope, receive, send)
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
                await error_response(too_big)(scope, receive, send)
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


def _parse_json(raw: bytes) -> Any:
    try:
        body = untrusted_json.loads(raw)
    except ValueError as e:  # bad JSON or UTF-8, an integer over 4,300 digits, nesting past untrusted_json's bound
        reason = getattr(e, "msg", None) or str(e)
        raise APIError(400, f"We could not parse the JSON body of your request ({reason}).",
                       "invalid_request_error", None, "invalid_json") from None
    if _SURROGATE.search(raw) and not _valid_unicode(body):
        raise APIError(400, "We could not parse the JSON body of your request (a string holds a lone UTF-16 "
                       "surrogate, which is not a character).", "invalid_request_error", None, "invalid_json")
    return body


def default_router(models: list[ServedModel]) -> Router:
    """Without a configuration: the first model serves every tier; every name of each model answers."""
    first = models[0]
    cfg = default_config(None, [first.names[0]], {})
    for m in models[1:]:
        cfg.models[m.names[0]] = LocalModelConfig(m.names[0], None)
    for m in models:
        for alias in m.names[1:]:
            cfg.aliases[alias] = m.names[0]
    return Router(cfg, prompt_counter(first))


# The unknown model's 404 names what works: at most this many names of each kind (the rest counted;
# GET /v1/models lists them all), and the name asked for cut to this many characters, so that a
# request cannot make the message long.
LISTED_NAMES = 8
ECHOED_NAME_CHARS = 64


def unknown_model(name: str, router: Router) -> APIError:
    """OpenAI's 404 for a model it does not serve, its message extended with the names this server
    answers to: models, tiers (with the model that serves each first), the routers that pick a tier
    per request, and aliases (with what each stands for)."""
    c = router.config
    models = {*c.models, *c.upstreams}
    stands_for = {**TIER_ALIASES, **c.aliases}
    kinds: dict[str, list[str]] = {"models": [], "tiers": [], "routers": [], "aliases": []}
    for n in router.names:
        if n in models:
            kinds["models"].append(n)
        elif n in c.tiers:
            kinds["tiers"].append(f"{n} ({c.tiers[n][0]})" if c.tiers[n] else n)
        elif n in ROUTER_NAMES:
            kinds["routers"].append(n)
        else:
            kinds["aliases"].append(f"{n} ({stands_for[n]})" if n in stands_for else n)
    parts, cut = [], False
    for kind, names in kinds.items():
        if names:
            more = len(names) - LISTED_NAMES
            cut |= more > 0
            listed = ", ".join(names[:LISTED_NAMES]) + (f" and {more} more" if more > 0 else "")
            parts.append(f"{listed} (a tier per request)" if kind == "routers" else f"{kind} {listed}")
    shown = name if len(name) <= ECHOED_NAME_CHARS else name[: ECHOED_NAME_CHARS - 1] + "…"
    message = (f"The model `{shown}` does not exist or you do not have access to it. Served here: "
               f"{'; '.join(parts)}.{' GET /v1/models lists every name.' if cut else ''}")
    return APIError(404, message, "invalid_request_error", "model", "model_not_found")


def prompt_counter(served: ServedModel):  # type: ignore[no-untyped-def]
    """Tokens of a request's text by a local tokenizer: what the routing rules measure."""

    def count(body: dict[str, Any]) -> int:
        if body.get("messages"):
            # Text parts only: other parts' keys are not validated, so anything may stand in their "text".
            text = "\n".join(t for m in body["messages"] if isinstance(m, dict)
                             for p in (m.get("content") if isinstance(m.get("content"), list) else [m.get("content")])
                             if isinstance(t := p.get("text") if isinstance(p, dict) else p, str))
        else:
            text = str(body.get("prompt", ""))
        return len(served.tokenizer.encode(text, add_special_tokens=False))

    return count


# How a lone surrogate can reach JSON text: as an escape, or as the UTF-8 bytes of one (ED A0..BF),
# which json.loads decodes with 'surrogatepass'.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _valid_unicode(value: Any) -> bool:
    """Whether every string in a parsed body is encodable (JSON escapes may leave a lone surrogate,
    which no tokenizer takes). Iterative: the body may be nested as deep as the parser allows."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def create_app(
    models: ServedModel | list[ServedModel],
    api_keys: list[str] | None = None,
    router: Router | None = None,
    upstreams: dict[str, UpstreamConfig] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    protect_metrics: bool = False,
    state_db: str | Path | None = None,
    responses: ResponsesService | None = None,
    prices: dict[str, dict[str, float]] | None = None,
    subagent_model: str | None = None,
) -> FastAPI:
    """The HTTP app over local models (each with its engine) and, through the router, upstreams.
    `protect_metrics`: /metrics and the dashboard's data need the API key too (by default they are
    open, as vLLM leaves /metrics, for a scraper on a private network). `state_db`: where stored
    responses live (a SQLite path or a SQLAlchemy URL; by default a file under the data directory,
    made on first use). `responses`: the Responses API's service, when its model turns should run on
    something else than this app's own chat completions (a scripted model, in tests). `prices`: USD per
    million tokens by model name, for the agents' cost accounting. `subagent_model`: where Ultra's
    sub-agents run unless a request says (default: the root's model)."""
    served_list = models if isinstance(models, list) else [models]
    router = router or default_router(served_list)
    upstreams = upstreams or {}
    pools = {name: ReplicaSet(up) for name, up in upstreams.items() if up.replicas}
    metrics = next((m.metrics for m in served_list if m.metrics is not None), None) or ServerMetrics()
    metrics.add_replicas(pools)
    local: dict[str, tuple[ServedModel, ChatHandler, CompletionHandler]] = {}
    for served in served_list:
        served.metrics = metrics
        metrics.add_model(served.names[0], served.engine)
        local[served.names[0]] = (served, ChatHandler(served), CompletionHandler(served))
    # One per registry: apps made again over the same models (in tests) share their metrics.
    monitor = getattr(metrics, "loop_monitor", None) or LoopMonitor(metrics.registry)
    metrics.loop_monitor = monitor  # type: ignore[attr-defined]

    agents: list[ResponsesService] = [responses] if responses is not None else []
    if responses is not None:
        responses.on_finish.append(metrics.agent_response)

    def check_model(name: str) -> None:
        if name not in router.names:
            raise unknown_model(name, router)

    def responses_service() -> ResponsesService:
        if not agents:  # the store's file is made on the first use of the Responses API, not at start
            draining = lambda: not all(m.engine.accepting for m in served_list)  # noqa: E731
            agents.append(ResponsesService(InProcessChat(answer, check_model, draining), ResponseStore(state_db),
                                           prices=prices, subagent_model=subagent_model))
            agents[0].on_finish.append(metrics.agent_response)
        return agents[0]

    async def check_replicas() -> None:
        interval = min(p.up.health_interval for p in pools.values())
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(p.check_health(http) for p in pools.values()), return_exceptions=True)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        monitor.start()
        checks = asyncio.get_running_loop().create_task(check_replicas()) if pools else None
        yield
        if checks is not None:
            checks.cancel()
            await asyncio.gather(checks, return_exceptions=True)
        await monitor.stop()
        for service in agents:  # parked programs die with the server
            await service.close()

    app = FastAPI(title="wafer", docs_url=None, redoc_url=None, lifespan=lifespan)
    static = files("wafer.server") / "static"
    keys = list(api_keys or [])
    app.state.served = served_list
    app.state.router = router
    app.state.agents = agents  # the Responses API's service, once made
    http = httpx.AsyncClient()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error", None, kind))

    async def authorize(request: Request) -> None:
        """Bearer keys, when the server has any (a dependency, not middleware: Starlette's
        BaseHTTPMiddleware would hide client disconnects from the handlers)."""
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        challenge = {"WWW-Authenticate": "Bearer"}  # RFC 6750: what a 401 asks for
        if not header:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           "invalid_request_error", None, "invalid_api_key", challenge)
        # Compared as bytes: compare_digest refuses str with non-ASCII characters, and any client may send
        # such a header (its bytes, which Starlette decoded as latin-1, against the key's UTF-8).
        given = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not any(secrets.compare_digest(given, k.encode()) for k in keys):
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key",
                           challenge)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        return await off_loop(len(raw) > OFF_LOOP_BYTES, _parse_json, raw)  # 2 MB take 60 ms to parse

    def model_card(name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": served_list[0].created, "owned_by": "wafer"}
        if name in local:
            card["max_model_len"] = local[name][0].max_model_len
            card["sampling_defaults"] = dict(local[name][0].sampling_defaults)  # unknown to OpenAI's clients
        return card

    async def dispatch(kind: str, request: Request) -> Response:
        return await answer(kind, await read_json(request), request)

    async def answer(kind: str, body: Any, request: Request) -> Response:
        """A chat or legacy completion of a parsed body, by whichever model the router picks: what the
        endpoints answer, and what the agents' model turns run through (with a request of their own)."""
        # Validating a body of megabytes takes a core for up to a second; so may the rules, which may
        # tokenize the whole text.
        heavy = len(await request.body()) > OFF_LOOP_BYTES
        req = await off_loop(heavy, parse_body, ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        try:
            decision = await off_loop(heavy, router.resolve, req.model, body)
        except UnknownModel:
            raise unknown_model(req.model, router) from None
        metrics.routes.labels(decision.rule, decision.tier or "-").inc()
        headers = {"x-wafer-route": decision.rule, "x-wafer-tier": decision.tier or ""}
        failures = []
        for target in decision.targets:
            if target in local:
                _, chat_handler, completion_handler = local[target]
                req.model = target  # the response names the model that served it
                if kind == "chat":
                    response = await chat_handler.chat(req, request)
                else:
                    response = await completion_handler.completions(req, request)
                response.headers.update({**headers, "x-wafer-model": target})
                return response
            up = upstreams[target]
            path = "/chat/completions" if kind == "chat" else "/completions"
            try:
                if target in pools:
                    reply, replica = await pools[target].forward(http, path, body)
                    headers["x-wafer-replica"] = replica.url
                else:
                    reply = await forward(http, up, path, body)
            except UpstreamUnavailable as e:
                log.warning("upstream %s could not answer (%s); falling back", target, e)
                metrics.fallbacks.labels(target).inc()
                failures.append(str(e))
                continue
            headers["x-wafer-model"] = up.model
            if reply.stream is not None:
                return StreamingResponse(reply.stream, media_type="text/event-stream", headers=headers)
            if reply.retry_after is not None:
                headers["Retry-After"] = reply.retry_after
            return JSONResponse(reply.json, status_code=reply.status, headers=headers)
        raise APIError(503, f"No server could answer for `{req.model}`: {'; '.join(failures)}", "server_error", None,
                       "upstream_unavailable", {"Retry-After": "5"})

    @app.get("/health")
    async def health() -> Response:
        ok = all(m.engine.accepting for m in served_list)
        faults = [f"{m.names[0]}: {fault}" for m in served_list if (fault := m.engine.stats().fault)]
        pipelines = {m.names[0]: info for m in served_list if (info := m.engine.stats().pipeline)}
        return JSONResponse({"status": ("ok" if not faults else "fault") if ok else "draining",
                             "faults": faults, **({"pipelines": pipelines} if pipelines else {}),
                             "running": sum(m.engine.num_running for m in served_list),
                             "waiting": sum(m.engine.num_waiting for m in served_list),
                             "models": [{"name": m.names[0], **m.compute} for m in served_list],
                             "warnings": [f"{m.names[0]}: {m.compute['warning']}" for m in served_list
                                          if m.compute.get("warning")]},
                            status_code=200 if ok and not faults else 503)

    monitoring = [Depends(authorize)] if protect_metrics else []

    @app.get("/metrics", dependencies=monitoring)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response((static / "dashboard.html").read_text(), media_type="text/html")

    @app.get("/dashboard.js")
    async def dashboard_js() -> Response:
        return Response((static / "dashboard.js").read_text(), media_type="application/javascript")

    @app.get("/dashboard/data", dependencies=monitoring)
    async def dashboard_data() -> dict[str, Any]:
        return metrics.snapshot()

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in router.names]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in router.names:
            raise unknown_model(model_id, router)
        return model_card(model_id)

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_json(request)
        model = body.get("model") if isinstance(body, dict) else None
        # Ultra by its name alone, as on /v1/responses: a name of its own (an alias, say) is that name's.
        if isinstance(model, str) and model.endswith(ULTRA) and model not in router.names \
                and model.removesuffix(ULTRA) in router.names:
            return await ultra_chat(responses_service(), body, request)
        return await answer("chat", body, request)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await dispatch("completions", request)

    @v1.post("/responses")
    async def create_response(request: Request) -> Response:
        req = await off_loop(len(await request.body()) > OFF_LOOP_BYTES, parse_body, ResponseRequest,
                             await read_json(request))
        service = responses_service()
        plan = await service.plan(req)
        if req.stream:
            return EventStreamResponse(sse(e) async for e in service.run(plan))
        final: dict[str, Any] = {}

        async def consume() -> None:
            async for event in service.run(plan):
                final["response"] = event.get("response", final.get("response"))  # the last event's is whole

        if not await unless_disconnect(consume(), request):  # a client gone cancels every turn and program
            return JSONResponse({}, status_code=499)
        if plan.failure is not None:
            raise plan.failure
        return JSONResponse(final["response"])

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return await responses_service().get(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await responses_service().delete(response_id)

    @v1.get("/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
        q = request.query_params
        limit = q.get("limit", "20")
        # ASCII digits, at most three: isdigit() also takes '²', which int() refuses, and a number of
        # thousands of digits, which int() refuses past 4,300.
        if not re.fullmatch(r"[0-9]{1,3}", limit) or not 1 <= int(limit) <= 100:
            raise APIError(400, "limit must be an integer from 1 to 100.", "invalid_request_error", "limit",
                           "invalid_value")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'.", "invalid_request_error", "order", "invalid_value")
        return await responses_service().input_items(response_id, q.get("after"), int(limit), order)

    app.include_router(v1)
    install_openapi(app, secured=bool(keys))
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(StatusCounter, metrics=metrics)
    return app
