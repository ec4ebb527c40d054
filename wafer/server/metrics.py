"""Prometheus metrics (`GET /metrics`), named and shaped after vLLM's with a `wafer:` prefix,
and the rolling window the dashboard draws from."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wafer.server.caller import Caller, current_caller

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEPS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)

# time.monotonic() when the request being handled reached the server, set by StatusCounter; a
# context variable because a stream's body runs in a task of its own, after the route has returned.
_ARRIVAL: ContextVar[float] = ContextVar("wafer_arrival")


def arrival() -> float:
    """When the request being handled arrived (now, outside one)."""
    at = _ARRIVAL.get(None)
    return time.monotonic() if at is None else at


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestTimer:
    """Times one request from its arrival at the server (as vLLM does, and as a client does from
    its send), for the histograms: TTFT to the first token delivered, latency to the last."""

    metrics: "ServerMetrics"
    model: str
    start: float = field(default_factory=arrival)
    first: float | None = None
    last: float | None = None  # when the latest token was produced
    caller: Caller | None = field(default_factory=current_caller)  # whose tokens these are
    charged: bool = False  # its tokens were charged to its tenant
    # Resolved once: `labels()` takes a lock and a lookup, and `tokens` runs for every token.
    _generated: Any = field(init=False, repr=False)
    _itl: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._generated = self.metrics.generation_tokens.labels(self.model)
        self._itl = self.metrics.itl.labels(self.model)

    def tokens(self, n: int) -> None:
        """Called when a chunk with n new tokens is produced."""
        if n <= 0:
            return
        now = time.monotonic()
        self._generated.inc(n)  # as they come, so rates are live
        if self.last is not None:
            self._itl.observe(now - self.last)
        self.last = now

    def delivered(self) -> None:
        """Called once the consumer has handled a chunk: a stream has written it to the client's
        socket, a whole response has kept it. The first chunk with tokens ends the TTFT there,
        not where it was produced, because a stream may only start writing after the engine has
        produced it."""
        if self.first is None and self.last is not None:
            self.first = time.monotonic()
            self.metrics.ttft.labels(self.model).observe(self.first - self.start)

    def charge(self, prompt_tokens: int, generation_tokens: int) -> None:
        """The request's tokens, to its tenant (once: when it finishes, or when it is cut short)."""
        if not self.charged:
            self.charged = True
            self.metrics.tenant_usage(self.caller, self.model, prompt_tokens, generation_tokens)

    def finish(self, reason: str | None, prompt_tokens: int, generation_tokens: int, queue_time: float | None) -> None:
        self.charge(prompt_tokens, generation_tokens)
        m, model = self.metrics, self.model
        now = time.monotonic()
        e2e = now - self.start
        m.e2e.labels(model).observe(e2e)
        if queue_time is not None:
            m.queue.labels(model).observe(queue_time)
        m.prompt_len.labels(model).observe(prompt_tokens)
        m.gen_len.labels(model).observe(generation_tokens)
        m.prompt_tokens.labels(model).inc(prompt_tokens)
        m.success.labels(model, reason or "unknown").inc()
        ttft = (self.first - self.start) if self.first is not None else None
        m.recent.append((time.time(), ttft, e2e, generation_tokens))


class ServerMetrics:
    """One registry for the server; each local model adds its labelled gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # USD per million tokens by model name ({"input": x, "output": y}), for the tenants' cost
        self.prices: dict[str, dict[str, float]] = {}
        # Told of each request's tokens (caller, prompt, completion, cost) and each error (caller,
        # status) of a tenant: the keys' limits and their use by day.
        self.usage_hooks: list[Callable[[Caller, int, int, float], None]] = []
        self.error_hooks: list[Callable[[Caller, int], None]] = []
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram("wafer:time_to_first_token_seconds",
                              "Time from the request's arrival to its first token (written, when streamed).", lbl,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("wafer:inter_token_latency_seconds", "Time between successive tokens of a request.", lbl,
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("wafer:e2e_request_latency_seconds",
                             "Request latency, arrival to last token (written, when streamed).", lbl,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("wafer:request_queue_time_seconds", "Time a request waited before it first ran.", lbl,
                               buckets=_LATENCY, registry=r)
        self.prompt_len = Histogram("wafer:request_prompt_tokens", "Prompt tokens per request.", lbl, buckets=_TOKENS,
                                    registry=r)
        self.gen_len = Histogram("wafer:request_generation_tokens", "Generated tokens per request.", lbl,
                                 buckets=_TOKENS, registry=r)
        self.prompt_tokens = Counter("wafer:prompt_tokens", "Prompt tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("wafer:generation_tokens", "Tokens generated.", lbl, registry=r)
        self.success = Counter("wafer:request_success", "Finished requests by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        self.errors = Counter("wafer:request_errors", "Requests answered with an error, by HTTP status.",
                              lbl + ["status"], registry=r)
        self.routes = Counter("wafer:route_requests", "Requests by the routing rule and tier that chose their model.",
                              ["rule", "tier"], registry=r)
        self.fallbacks = Counter("wafer:upstream_fallbacks", "Targets skipped because they could not answer.",
                                 ["target"], registry=r)
        # /v1/responses, by the mode of its accounting (wafer/agents/responses.py: mode_of)
        self.agent_responses = Counter("wafer:agent_responses", "Responses of /v1/responses by mode and status.",
                                       ["mode", "status"], registry=r)
        self.agent_tokens = Counter("wafer:agent_tokens", "Tokens the model read (input) and wrote (output) for "
                                    "/v1/responses, by mode.", ["mode", "direction"], registry=r)
        self.agent_turns = Counter("wafer:agent_model_turns", "Model turns behind /v1/responses, by mode.", ["mode"],
                                   registry=r)
        self.agent_cost = Counter("wafer:agent_cost_usd", "Cost of /v1/responses by mode, from the prices in "
                                  "wafer.toml.", ["mode"], registry=r)
        self.agent_seconds = Counter("wafer:agent_seconds", "Wall time of /v1/responses by mode (a task's time is "
                                     "the sum over its responses).", ["mode"], registry=r)
        self.agent_tool_calls = Counter("wafer:agent_tool_calls", "Tool calls by their caller: the model (direct) "
                                        "or a program (programmatic).", ["caller"], registry=r)
        self.agent_programs = Histogram("wafer:agent_program_seconds", "Running time of each program (not counting "
                                        "time parked for tool outputs), by how it ended.", ["status"],
                                        buckets=_LATENCY, registry=r)
        self.reasoning_tokens = Counter("wafer:reasoning_tokens", "Tokens of reasoning before the answer (a "
                                        "model's own thinking or wafer's reasoning turn), by reasoning_effort.",
                                        lbl + ["effort"], registry=r)
        tl = ["tenant"]  # a key's tenant (wafer keys), where the server has keys
        self.tenant_requests = Counter("wafer:tenant_requests", "Requests to the generating endpoints, by tenant "
                                       "(those refused for a limit included).", tl, registry=r)
        self.tenant_tokens = Counter("wafer:tenant_tokens", "Tokens read (input) and written (output) for each "
                                     "tenant, by local models.", tl + ["direction"], registry=r)
        self.tenant_cost = Counter("wafer:tenant_cost_usd", "Cost of each tenant's tokens, from the prices in "
                                   "wafer.toml.", tl, registry=r)
        self.tenant_errors = Counter("wafer:tenant_errors", "Requests of each tenant answered with an error, by "
                                     "HTTP status.", tl + ["status"], registry=r)
        self.tenant_limited = Counter("wafer:tenant_rate_limited", "Requests refused with a 429 for a key's limit, "
                                      "by tenant and limit (requests, tokens, daily_tokens, concurrency).",
                                      tl + ["limit"], registry=r)
        self.running = Gauge("wafer:num_requests_running", "Sequences in the running batch.", lbl, registry=r)
        self.waiting = Gauge("wafer:num_requests_waiting", "Requests waiting to run.", lbl, registry=r)
        self.kv = Gauge("wafer:kv_cache_usage_perc",
                        "Fraction of the KV cache's blocks held by running sequences (0 to 1).", lbl, registry=r)
        self.kv_peak = Gauge("wafer:kv_cache_peak_usage_perc",
                             "The largest fraction of the KV cache's blocks held at once since start.", lbl, registry=r)
        self.kv_capacity = Gauge("wafer:kv_cache_capacity_bytes", "Bytes of KV the cache's blocks can hold (its "
                                 "budget: --kv-cache-memory).", lbl, registry=r)
        self.kv_written = Gauge("wafer:kv_cache_written_bytes", "Bytes of the KV cache's blocks written at least "
                                "once since start: the cache takes memory on first write and keeps it (prefix-cached "
                                "blocks keep their KV), so resident memory grows with this up to the capacity.",
                                lbl, registry=r)
        self.step_seconds = Histogram("wafer:engine_step_seconds", "Wall time of each engine step, by kind (prompt: "
                                      "it computed prompt tokens, with or without decodes; decode: only decodes).",
                                      [*lbl, "kind"], buckets=_STEPS, registry=r)
        self.mask_seconds = Histogram("wafer:grammar_mask_seconds", "Wall time of each engine step's grammar work "
                                      "(llguidance's masks and the searches for a way to close the JSON within "
                                      "max_tokens), for the steps that had any; every stream waits as long.",
                                      lbl, buckets=_STEPS, registry=r)
        self.mask_cpu_seconds = Histogram("wafer:grammar_mask_cpu_seconds", "CPU time of the same work (of the "
                                          "thread that steps the engine): on a machine shared with other jobs, what "
                                          "the grammars cost apart from the wait for a core.", lbl, buckets=_STEPS,
                                          registry=r)
        self.batch = Gauge("wafer:batch_size", "Sequences advanced by the last engine step.", lbl, registry=r)
        self.prefix_hit_rate = Gauge("wafer:prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens looked up.", lbl,
                                     registry=r)
        self.engines: dict[str, Any] = {}
        r.register(_SpecDecodeCollector(self.engines))
        self.replica_sets: dict[str, Any] = {}
        r.register(_ReplicaCollector(self.replica_sets))
        self.recent: deque[tuple[float, float | None, float, int]] = deque(maxlen=5000)
        self.started = time.time()

    def add_model(self, name: str, engine: Any) -> None:
        """Live gauges for a local model's engine (an AsyncEngine)."""
        self.engines[name] = engine
        self.running.labels(name).set_function(lambda: engine.stats().running)
        self.waiting.labels(name).set_function(lambda: engine.stats().waiting)
        self.kv.labels(name).set_function(lambda: engine.stats().kv_usage)
        self.kv_peak.labels(name).set_function(lambda: engine.stats().kv_peak_usage)
        self.kv_capacity.labels(name).set_function(lambda: engine.stats().kv_capacity_bytes)
        self.kv_written.labels(name).set_function(lambda: engine.stats().kv_written_bytes)
        self.batch.labels(name).set_function(lambda: engine.stats().last_batch_size)
        engine.step_observers.append(lambda step: self.step_seconds.labels(name, step.kind).observe(step.seconds))
        engine.step_observers.append(lambda step: step.mask_seconds and self._masked(name, step))
        self.prefix_hit_rate.labels(name).set_function(lambda: engine.stats().prefix_hit_rate)

    def _masked(self, name: str, step: Any) -> None:
        self.mask_seconds.labels(name).observe(step.mask_seconds)
        self.mask_cpu_seconds.labels(name).observe(step.mask_cpu_seconds)

    def add_replicas(self, pools: dict[str, Any]) -> None:
        """An upstream's replicas (router/replicas.py ReplicaSets, by upstream name), read at scrape time."""
        self.replica_sets.update(pools)

    def request(self, model: str) -> RequestTimer:
        return RequestTimer(self, model)

    def agent_response(self, response: dict[str, Any]) -> None:
        """Counts a finished /v1/responses response from its usage and accounting."""
        acct = response.get("accounting") or {}
        mode = acct.get("mode", "direct")
        self.agent_responses.labels(mode, response["status"]).inc()
        usage = response.get("usage") or {}
        self.agent_tokens.labels(mode, "input").inc(usage.get("input_tokens", 0))
        self.agent_tokens.labels(mode, "output").inc(usage.get("output_tokens", 0))
        self.agent_turns.labels(mode).inc(len(acct.get("turns") or []))
        self.agent_cost.labels(mode).inc(acct.get("cost_usd") or 0.0)
        self.agent_seconds.labels(mode).inc(acct.get("seconds") or 0.0)
        for caller, n in (acct.get("tool_calls") or {}).items():
            self.agent_tool_calls.labels(caller).inc(n)
        for run in acct.get("programs") or []:
            self.agent_programs.labels(run["status"]).observe(run["seconds"])

    def tenant_usage(self, caller: Caller | None, model: str, prompt: int, completion: int) -> None:
        if caller is None or caller.tenant is None:
            return
        price = self.prices.get(model) or {}
        cost = (prompt * price.get("input", 0.0) + completion * price.get("output", 0.0)) / 1e6
        self.tenant_tokens.labels(caller.tenant, "input").inc(prompt)
        self.tenant_tokens.labels(caller.tenant, "output").inc(completion)
        self.tenant_cost.labels(caller.tenant).inc(cost)
        for hook in self.usage_hooks:
            hook(caller, prompt, completion, cost)

    def tenant_error(self, caller: Caller | None, status: int) -> None:
        if caller is None or caller.tenant is None:
            return
        self.tenant_errors.labels(caller.tenant, str(status)).inc()
        for hook in self.error_hooks:
            hook(caller, status)

    def _tenants(self) -> dict[str, dict[str, float]]:
        """Per tenant: requests, tokens read and written, cost, errors, requests refused for a limit."""
        return _rows(((self.tenant_requests, "requests"), (self.tenant_tokens, None), (self.tenant_cost, "cost_usd"),
                      (self.tenant_errors, "errors"), (self.tenant_limited, "rate_limited")),
                     "tenant", ("input_tokens", "output_tokens"),
                     {"requests": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0, "errors": 0,
                      "rate_limited": 0})

    def reasoning(self, model: str, effort: str, tokens: int) -> None:
        self.reasoning_tokens.labels(model, effort).inc(tokens)

    def error(self, status: int, model: str = "") -> None:
        self.errors.labels(model, str(status)).inc()

    def _agents(self) -> dict[str, dict[str, float]]:
        """Per mode of /v1/responses: responses, tokens read and written, model turns, seconds, cost."""
        return _rows(((self.agent_responses, "responses"), (self.agent_tokens, None), (self.agent_turns, "turns"),
                      (self.agent_cost, "cost_usd"), (self.agent_seconds, "seconds")),
                     "mode", ("tokens_read", "tokens_written"), {})

    def snapshot(self, window: float = 60.0) -> dict[str, Any]:
        """What the dashboard shows: totals, and percentiles over the last `window` seconds."""
        now = time.time()
        recent = [x for x in self.recent if x[0] >= now - window]
        ttfts = [x[1] for x in recent if x[1] is not None]
        e2es = [x[2] for x in recent]

        def total(counter: Counter) -> float:
            return sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))

        errors: dict[str, float] = {}
        for metric in self.errors.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    errors[s.labels["status"]] = s.value
        stats = [e.stats() for e in self.engines.values()]
        return {
            "time": now,
            "model": ", ".join(self.engines),
            "generation_tokens_total": total(self.generation_tokens),
            "prompt_tokens_total": total(self.prompt_tokens),
            "requests_total": total(self.success),
            "agents": self._agents(),
            "tenants": self._tenants(),
            "errors": errors,
            "running": sum(s.running for s in stats),
            "waiting": sum(s.waiting for s in stats),
            "kv_cache_usage": max((s.kv_usage for s in stats), default=0.0),
            "ttft_p50": _percentile(ttfts, 0.5),
            "ttft_p95": _percentile(ttfts, 0.95),
            "e2e_p50": _percentile(e2es, 0.5),
            "e2e_p95": _percentile(e2es, 0.95),
            "window_requests": len(recent),
            "speculation": _speculation([s.spec for s in stats]),
        }


def _speculation(specs: list[Any]) -> dict[str, Any]:
    """Speculative decoding over the engines since start: steps, drafts and tokens kept, in all and
    by proposer (the dashboard's table)."""
    out: dict[str, Any] = {"steps": sum(s.decode_steps for s in specs), "drafts": sum(s.drafts for s in specs),
                           "accepted_tokens": sum(s.accepted_tokens for s in specs), "methods": {}}
    for s in specs:
        for method, m in s.by_method.items():
            row = out["methods"].setdefault(method, {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})
            row["drafts"] += m.drafts
            row["draft_tokens"] += m.draft_tokens
            row["accepted_tokens"] += m.accepted_tokens
    return out


class _SpecDecodeCollector:
    """Speculative decoding and preemption counters as vLLM names them, read from the engines at scrape time."""

    def __init__(self, engines: dict[str, Any]) -> None:
        self.engines = engines

    def collect(self):  # type: ignore[no-untyped-def]
        lbl = ["model_name"]
        drafts = CounterMetricFamily("wafer:spec_decode_num_drafts", "Proposals verified (one per sequence and step).",
                                     labels=lbl)
        tokens = CounterMetricFamily("wafer:spec_decode_num_draft_tokens", "Tokens proposed.", labels=lbl)
        accepted = CounterMetricFamily("wafer:spec_decode_num_accepted_tokens", "Proposed tokens kept.", labels=lbl)
        per_pos = CounterMetricFamily("wafer:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens kept, by their position in the proposal.",
                                      labels=lbl + ["position"])
        length = GaugeMetricFamily("wafer:spec_decode_mean_acceptance_length",
                                   "Tokens per verifying step: 1 + accepted / drafts (0 before any draft).", labels=lbl)
        preempted = CounterMetricFamily("wafer:num_preemptions", "Running sequences stopped for want of KV "
                                        "blocks, to be computed again (as vLLM's num_preemptions).", labels=lbl)
        steps = CounterMetricFamily("wafer:spec_decode_num_steps", "Decoding steps of a sequence, drafted or "
                                    "not: drafts over these is the share of steps that drafted.", labels=lbl)
        cut = CounterMetricFamily("wafer:spec_decode_num_grammar_cut_tokens", "Tokens proposed for a sequence under "
                                  "a grammar (tools, response_format) that it refused, cut before verification.",
                                  labels=lbl)
        per_step = HistogramMetricFamily("wafer:spec_decode_accepted_tokens_per_step",
                                         "Proposed tokens kept by each step that verified a draft.", labels=lbl)
        by = lbl + ["method"]
        m_drafts = CounterMetricFamily("wafer:spec_decode_method_num_drafts", "Proposals verified, by the "
                                       "proposer that made them (ngram, suffix, draft).", labels=by)
        m_tokens = CounterMetricFamily("wafer:spec_decode_method_num_draft_tokens", "Tokens proposed, by proposer.",
                                       labels=by)
        m_accepted = CounterMetricFamily("wafer:spec_decode_method_num_accepted_tokens",
                                         "Proposed tokens kept, by proposer.", labels=by)
        for name, engine in self.engines.items():
            snap = engine.stats()
            st = snap.spec
            drafts.add_metric([name], st.drafts)
            tokens.add_metric([name], st.draft_tokens)
            accepted.add_metric([name], st.accepted_tokens)
            for pos, n in enumerate(st.accepted_per_pos):
                per_pos.add_metric([name, str(pos)], n)
            length.add_metric([name], st.mean_acceptance_length)
            preempted.add_metric([name], snap.num_preemptions)
            steps.add_metric([name], st.decode_steps)
            cut.add_metric([name], st.grammar_cut_tokens)
            buckets, seen = [], 0
            for kept, n in enumerate(st.accepted_hist):
                seen += n
                buckets.append((str(kept), seen))
            buckets.append(("+Inf", st.drafts))
            per_step.add_metric([name], buckets, st.accepted_tokens)
            for method, m in sorted(st.by_method.items()):
                m_drafts.add_metric([name, method], m.drafts)
                m_tokens.add_metric([name, method], m.draft_tokens)
                m_accepted.add_metric([name, method], m.accepted_tokens)
        yield from (drafts, tokens, accepted, per_pos, length, preempted, steps, cut, per_step, m_drafts, m_tokens,
                    m_accepted)


class _ReplicaCollector:
    """Each replica's load, requests, errors and health, as the router that shares requests among
    them sees it."""

    def __init__(self, pools: dict[str, Any]) -> None:
        self.pools = pools

    def collect(self):  # type: ignore[no-untyped-def]
        lbl = ["upstream", "replica"]
        outstanding = GaugeMetricFamily("wafer:replica_requests_outstanding", "Requests in flight to the replica.",
                                        labels=lbl)
        requests = CounterMetricFamily("wafer:replica_requests", "Requests sent to the replica (tries included).",
                                       labels=lbl)
        errors = CounterMetricFamily("wafer:replica_errors", "Tries the replica could not answer (then the "
                                     "request went to another), and failed health checks.", labels=lbl)
        healthy = GaugeMetricFamily("wafer:replica_healthy", "1 when the replica takes requests, 0 while it "
                                    "cools down after a failure.", labels=lbl)
        for name, pool in self.pools.items():
            up = {r.url for r in pool.healthy()}
            for r in pool.replicas:
                outstanding.add_metric([name, r.url], r.outstanding)
                requests.add_metric([name, r.url], r.requests)
                errors.add_metric([name, r.url], r.errors)
                healthy.add_metric([name, r.url], 1.0 if r.url in up else 0.0)
        yield from (outstanding, requests, errors, healthy)


class StatusCounter:
    """Counts every HTTP error status the app sends (including 404s and 413s raised before any
    handler runs), and notes when each request arrived: create_app adds it last, so that it runs
    first, before the body is read, and a request's latencies count all the server did for it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        _ARRIVAL.set(time.monotonic())

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and message["status"] != 499:
                self.metrics.error(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def _rows(counters: tuple[tuple[Counter, str | None], ...], label: str, directions: tuple[str, str],
          blank: dict[str, float]) -> dict[str, dict[str, float]]:
    """The counters' totals as a row per value of `label`, each counter a column named by its key; a
    counter keyed None is split by its `direction` label into the columns `directions` (input, output)."""
    out: dict[str, dict[str, float]] = {}
    for counter, key in counters:
        for metric in counter.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    name = key or (directions[0] if s.labels["direction"] == "input" else directions[1])
                    row = out.setdefault(s.labels[label], dict(blank))
                    row[name] = row.get(name, 0) + s.value
    return out
