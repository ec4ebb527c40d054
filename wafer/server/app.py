"""The FastAPI application: routes, authentication, body limits, and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wafer import tracing, untrusted_json
from wafer.agents.items import ResponseRequest
from wafer.agents.ptc import ProgramPool
from wafer.agents.responses import ResponsesService, sse
from wafer.agents.store import ResponseStore, default_path
from wafer.config import ProgramLimits, ProgramPoolSettings, ServerSettings
from wafer.router.config import ROUTER_NAMES, TIER_ALIASES, LocalModelConfig, UpstreamConfig, default_config
from wafer.router.router import Router, UnknownModel
from wafer.router.replicas import ReplicaSet
from wafer.router.upstream import UpstreamUnavailable, forward
from wafer.server.batch_routes import add_batch_routes
from wafer.server.batch_store import BatchStore
from wafer.server.batches import Batches
from wafer.server.chat import ChatHandler
from wafer.server.completions import CompletionHandler
from wafer.server.errors import APIError, CatchAll, error_response
from wafer.server.generation import BACKGROUND, OFF_LOOP_BYTES, ServedModel, off_loop, unless_disconnect
from wafer.server.in_process import InProcessChat, in_process_request
from wafer.server.caller import CALLER, Caller, current_caller
from wafer.server.key_store import KeyStore
from wafer.server.metrics import ServerMetrics, StatusCounter
from wafer.server.tenants import Gate, Tenancy
from wafer.server.loop_monitor import LoopMonitor
from wafer.server.openapi import install_openapi
from wafer.server.streaming import EventStreamResponse
from wafer.server.ultra_chat import ULTRA, ultra_chat
from wafer.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body

log = logging.getLogger("wafer.server")

MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyLimit:
    """413 for a body over the limit, whether it declares its length or streams it in chunks.
    `paths`: larger limits by path (an uploaded file's)."""

    def __init__(self, app: ASGIApp, limit: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope.get("path", ""), self.limit)
        too_big = APIError(413, f"Request body too large (limit {limit} bytes).", "invalid_request_error",
                           None, "request_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        # Too many digits for any body (and for int(), past 4,300) is over the limit too.
        if declared is not None and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
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
            if seen > limit:
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


class Traced:
    """A span for each request to a generating route (wafer/tracing.py), current while the request is
    handled and ended once its response is sent (a stream's, after its last event)."""

    def __init__(self, app: ASGIApp, tracer: tracing.Tracing) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = tracing.OPERATIONS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if operation is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        span = self.tracer.request(operation, headers)
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            with tracing.within(span):
                await self.app(scope, receive, sending)
        finally:
            span.set({"http.response.status_code": status})
            if status >= 400:
                span.fail(f"HTTP {status}")
            span.end()


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


def not_allowed(name: str) -> APIError:
    """OpenAI's 404 for a model the caller's key may not use (it does not say which it may)."""
    shown = name if len(name) <= ECHOED_NAME_CHARS else name[: ECHOED_NAME_CHARS - 1] + "…"
    return APIError(404, f"The model `{shown}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


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
    key_store: KeyStore | None = None,
    max_file_bytes: int = ServerSettings.max_file_bytes,
    tracer: tracing.Tracing | None = None,
    program_limits: ProgramLimits | None = None,
    programs: ProgramPoolSettings | None = None,
) -> FastAPI:
    """The HTTP app over local models (each with its engine) and, through the router, upstreams.
    `protect_metrics`: /metrics and the dashboard's data need the API key too (by default they are
    open, as vLLM leaves /metrics, for a scraper on a private network). `state_db`: where stored
    responses live (a SQLite path or a SQLAlchemy URL; by default a file under the data directory,
    made on first use). `responses`: the Responses API's service, when its model turns should run on
    something else than this app's own chat completions (a scripted model, in tests). `prices`: USD per
    million tokens by model name, for the agents' cost accounting. `subagent_model`: where Ultra's
    sub-agents run unless a request says (default: the root's model). `key_store`: the tenants' keys
    (wafer keys; wafer/server/tenants.py), beside `api_keys`, which are each a tenant of their own.
    `max_file_bytes`: the largest file /v1/files takes (a batch's input); batches and their files live
    in the `state_db` store too.
    `tracer`: where the requests' spans go (wafer/tracing.py); None, the default, traces nothing.
    `program_limits`, `programs`: model-written programs' limits, one program's and the server's over
    all of them (wafer.toml's [sandbox] and the flags; their defaults where None)."""
    served_list = models if isinstance(models, list) else [models]
    router = router or default_router(served_list)
    upstreams = upstreams or {}
    pools = {name: ReplicaSet(up) for name, up in upstreams.items() if up.replicas}
    metrics = next((m.metrics for m in served_list if m.metrics is not None), None) or ServerMetrics()
    metrics.add_replicas(pools)
    metrics.prices = dict(prices or {})
    tenancy = Tenancy(list(api_keys or []), key_store, metrics, protect_metrics)
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
                                           ProgramPool.of(programs or ProgramPoolSettings()), program_limits,
                                           prices=prices, subagent_model=subagent_model))
            agents[0].on_finish.append(metrics.agent_response)
        return agents[0]

    stores: list[BatchStore] = []

    def batch_store() -> BatchStore:
        if not stores:  # made on the first use of the Batch API, or at start where a store exists
            stores.append(BatchStore(state_db))
        return stores[0]

    async def execute_line(url: str, body: dict[str, Any], owner: str | None) -> tuple[int, dict[str, Any]]:
        """A batch line through its endpoint, as background work: its HTTP status and JSON body."""
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}  # a batch line is whole
        request = in_process_request(body, url, owner)
        BACKGROUND.set(True)  # this line's task and those it starts (the Responses API's turns)
        maker = CALLER.get()  # the key that made the batch (none in a batch resumed after a restart)
        CALLER.set(Caller(owner, maker.key if maker is not None and maker.tenant == owner else None, batch=True))
        try:
            if url == "/v1/responses":
                response = await respond(body, request)
            else:
                response = await answer("chat" if url == "/v1/chat/completions" else "completions", body, request)
            raw = bytes(response.body)  # (a whole answer: the line asked for no stream)
            return response.status_code, json.loads(raw) if raw else {}
        except APIError as e:
            return e.status, e.body()
        except Exception:
            log.exception("a batch line failed")
            return 500, APIError(500, "Internal error.", "server_error", None, "internal_error").body()

    # As many lines at a time as the largest engine runs sequences: each line takes one when idle.
    window = max(m.engine.max_running for m in served_list)
    batches = Batches(batch_store, execute_line, window)

    def existing_store() -> bool:
        where = state_db if state_db is not None else default_path()
        return (isinstance(where, str) and "://" in where) or Path(where).exists()

    async def check_replicas() -> None:
        interval = min(p.up.health_interval for p in pools.values())
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(p.check_health(http) for p in pools.values()), return_exceptions=True)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        monitor.start()
        checks = asyncio.get_running_loop().create_task(check_replicas()) if pools else None
        writing = asyncio.get_running_loop().create_task(tenancy.keep_writing()) if key_store else None
        if existing_store():  # batches a server stopped before they ended run now
            try:
                await batches.resume()
            except Exception:
                log.exception("could not resume the batches of %s", state_db or default_path())
        yield
        await batches.close()  # their running lines stop and keep no result: they run after a restart
        for store in stores:
            store.close()
        for task in (checks, writing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await tenancy.flush()  # the keys' use since the last write
        await monitor.stop()
        for service in agents:  # parked programs die with the server
            await service.close()
        if tracer is not None:
            tracer.shutdown()  # the spans not yet sent

    # FastAPI's own telemetry off: wafer's spans are the requests' (wafer/tracing.py), and FastAPI's
    # would make a second span per request wherever a global tracer provider is set.
    app = FastAPI(title="wafer", docs_url=None, redoc_url=None, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "auto_configure": False})
    static = files("wafer.server") / "static"
    app.state.tenancy = tenancy
    app.state.served = served_list
    app.state.router = router
    app.state.agents = agents  # the Responses API's service, once made
    app.state.batches = batches
    http = httpx.AsyncClient()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error", None, kind))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(tenancy.authorize)])
    limited = [Depends(tenancy.admit)]  # the generating routes: within the key's limits

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
        if not tenancy.allows(req.model, router.config.aliases):
            raise not_allowed(req.model)
        span = tracing.current()
        if span is not None:
            operation = "chat" if kind == "chat" else "text_completion"
            span.span.update_name(f"{operation} {req.model}")
            span.set({tracing.OPERATION: operation, tracing.REQUEST_MODEL: req.model,
                      tracing.MAX_TOKENS: req.output_limit, tracing.TEMPERATURE: req.temperature,
                      tracing.TOP_P: req.top_p, tracing.CHOICES: req.n if req.n > 1 else None,
                      "wafer.route": decision.rule, "wafer.tier": decision.tier})
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
                if span is not None:
                    span.set({tracing.RESPONSE_MODEL: target})
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
            if span is not None:
                span.set({tracing.RESPONSE_MODEL: up.model, "wafer.upstream": target})
            usage = reply.json.get("usage") if reply.stream is None and isinstance(reply.json, dict) else None
            if isinstance(usage, dict):  # an upstream's tokens are its tenant's too (a stream's are not counted)
                metrics.tenant_usage(current_caller(), target, int(usage.get("prompt_tokens") or 0),
                                     int(usage.get("completion_tokens") or 0))
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

    monitoring = [Depends(tenancy.monitor)]

    @app.get("/metrics", dependencies=monitoring)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", dependencies=[Depends(tenancy.monitor_page)])
    async def dashboard() -> Response:
        return Response((static / "dashboard.html").read_text(), media_type="text/html")

    @app.get("/dashboard.js")
    async def dashboard_js() -> Response:
        return Response((static / "dashboard.js").read_text(), media_type="application/javascript")

    @app.get("/dashboard/data", dependencies=monitoring)
    async def dashboard_data(request: Request) -> dict[str, Any]:
        window = request.query_params.get("window", "60")
        # Seconds back that the percentiles cover: a whole number from 1 to a day.
        if not re.fullmatch(r"[0-9]{1,5}", window) or not 1 <= int(window) <= 86_400:
            raise APIError(400, "window must be a whole number of seconds from 1 to 86400.", "invalid_request_error",
                           "window", "invalid_value")
        return metrics.snapshot(float(window))

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in router.names
                                           if tenancy.allows(n, router.config.aliases)]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in router.names:
            raise unknown_model(model_id, router)
        if not tenancy.allows(model_id, router.config.aliases):
            raise not_allowed(model_id)
        return model_card(model_id)

    @v1.post("/chat/completions", dependencies=limited)
    async def chat(request: Request) -> Response:
        body = await read_json(request)
        model = body.get("model") if isinstance(body, dict) else None
        # Ultra by its name alone, as on /v1/responses: a name of its own (an alias, say) is that name's.
        if isinstance(model, str) and model.endswith(ULTRA) and model not in router.names \
                and model.removesuffix(ULTRA) in router.names:
            return await ultra_chat(responses_service(), body, request)
        return await answer("chat", body, request)

    @v1.post("/completions", dependencies=limited)
    async def completions(request: Request) -> Response:
        return await dispatch("completions", request)

    @v1.post("/responses", dependencies=limited)
    async def create_response(request: Request) -> Response:
        return await respond(await read_json(request), request)

    async def respond(body: Any, request: Request) -> Response:
        """A Responses API request of a parsed body: the endpoint, and a batch's lines."""
        req = await off_loop(len(await request.body()) > OFF_LOOP_BYTES, parse_body, ResponseRequest, body)
        service = responses_service()
        plan = await service.plan(req, request.state.tenant)
        if (span := tracing.current()) is not None:
            span.span.update_name(f"invoke_agent {plan.req.model}")
            span.set({tracing.REQUEST_MODEL: plan.req.model, tracing.RESPONSE_ID: plan.rid,
                      tracing.MAX_TOKENS: req.max_output_tokens, tracing.TEMPERATURE: req.temperature,
                      tracing.TOP_P: req.top_p, tracing.AGENT_NAME: "ultra" if plan.ultra else "wafer"})
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
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses_service().get(response_id, request.state.tenant)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses_service().delete(response_id, request.state.tenant)

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
        return await responses_service().input_items(response_id, q.get("after"), int(limit), order,
                                                     request.state.tenant)

    add_batch_routes(v1, batches, max_file_bytes, read_json)
    app.include_router(v1)
    install_openapi(app, secured=tenancy.on)
    app.add_middleware(CatchAll)
    app.add_middleware(Gate, tenancy=tenancy)
    # An upload's multipart body holds the file and a few fields: room for those beside it.
    app.add_middleware(BodyLimit, limit=max_body_bytes, paths={"/v1/files": max(max_body_bytes, max_file_bytes + 2**16)})
    app.add_middleware(StatusCounter, metrics=metrics)
    if tracer is not None:  # outermost: the span times the whole request, refusals included
        app.add_middleware(Traced, tracer=tracer)
    return app
