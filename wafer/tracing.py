"""OpenTelemetry traces of the requests, with the GenAI semantic conventions' attributes.

Off unless an OTLP endpoint is given (`--otlp-endpoint`, wafer.toml's `otlp_endpoint`, or the
standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT). Off, the server holds
no `Tracing`, every hook below finds `CURRENT` empty and makes nothing, and the SDK is not imported.

On, a request to /v1/chat/completions, /v1/completions or /v1/responses has a span (parented under
its `traceparent` header, when it brings one) that `CURRENT` holds while the request is handled, so
that whatever runs for it (the handlers, the agents' model turns, Ultra's sub-agents in their own
tasks, which copy the context) hangs its spans under it. The engine knows nothing of this: it keeps
plain timestamps on each request (`EngineRequest.scheduled`, `first_token`, `finished`), and the
spans of queueing, the prompt steps and decoding are made from them after the fact, with explicit
start and end times.

The provider is wafer's own, never the global one: FastAPI makes HTTP spans of its own once a global
provider is set, which would double every request's span (the app is made with FastAPI's telemetry
off, see wafer/server/app.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# The attributes' names, from the GenAI semantic conventions (opentelemetry.io/docs/specs/semconv/gen-ai/).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
CHOICES = "gen_ai.request.choice.count"
AGENT_NAME = "gen_ai.agent.name"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"

# The routes whose requests have a span, and the GenAI operation each is.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/responses": "invoke_agent"}


def endpoint_of(given: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The traces' OTLP/HTTP URL: `given` (--otlp-endpoint or wafer.toml's, a collector's base URL
    such as http://localhost:4318, or the full URL of its /v1/traces), else the standard variables;
    None: tracing is off."""
    env = os.environ if env is None else env
    if given:
        return given if given.rstrip("/").endswith("/v1/traces") else given.rstrip("/") + "/v1/traces"
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]  # the signal's own variable is the whole URL
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    return None


class Tracing:
    """wafer's tracer provider and tracer, over an OTLP/HTTP exporter (or the exporter given, in tests)."""

    def __init__(self, endpoint: str | None = None, exporter: Any = None, service_name: str = "wafer") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.endpoint = endpoint
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name})
        self.provider = TracerProvider(resource=resource)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # Headers, timeout and compression come from the standard OTEL_EXPORTER_OTLP_* variables.
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("wafer")

    def request(self, operation: str, headers: Mapping[str, str]) -> Span:
        """The span of one HTTP request, under the trace its `traceparent` header names, if any."""
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        parent = extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(operation, context=parent, kind=SpanKind.SERVER,
                                      attributes={OPERATION: operation, PROVIDER: "wafer"})
        return Span(self, span)

    def shutdown(self) -> None:
        self.provider.shutdown()  # sends what the batch holds


@dataclass
class Span:
    """An OpenTelemetry span with the tracing it belongs to, so that children are made by the same tracer."""

    tracing: Tracing
    span: Any  # opentelemetry.trace.Span

    def set(self, attributes: Mapping[str, Any]) -> None:
        """Set the attributes given, skipping the Nones (what a request leaves out is not said)."""
        for key, value in attributes.items():
            if value is not None:
                self.span.set_attribute(key, value)

    def child(self, name: str, attributes: Mapping[str, Any] | None = None, start: float | None = None) -> Span:
        """A span under this one, begun at `start` (time.monotonic()) or now."""
        from opentelemetry.trace import set_span_in_context

        span = self.tracing.tracer.start_span(name, context=set_span_in_context(self.span),
                                              start_time=None if start is None else _ns(start),
                                              attributes={k: v for k, v in (attributes or {}).items()
                                                          if v is not None})
        return Span(self.tracing, span)

    def done(self, name: str, start: float, end: float, attributes: Mapping[str, Any] | None = None) -> None:
        """A child span of work already done, from `start` to `end` (time.monotonic())."""
        self.child(name, attributes, start).end(end)

    def end(self, at: float | None = None) -> None:
        self.span.end(end_time=None if at is None else _ns(at))

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, message))


def _ns(monotonic: float) -> int:
    """Epoch nanoseconds of a time.monotonic() reading."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


# The span that what runs now works for: a request's, an agent's, a model turn's. None with tracing off.
CURRENT: ContextVar[Span | None] = ContextVar("wafer_span", default=None)


def current() -> Span | None:
    return CURRENT.get()


@contextmanager
def within(span: Span | None) -> Iterator[Span | None]:
    """`span` as the current one for the block. The previous value is put back by value, not by
    token: the block may be the body of an async generator, which a later context may close."""
    before = CURRENT.get()
    CURRENT.set(span)
    try:
        yield span
    finally:
        CURRENT.set(before)


def engine_spans(parent: Span, reqs: list[Any], end: float) -> None:
    """Queueing, the prompt steps and decoding of each engine request (one per choice) as children
    of `parent`, from the timestamps the engine kept; a request cut short ends at `end`."""
    for i, r in enumerate(reqs):
        choice = {"wafer.choice": i} if len(reqs) > 1 else {}
        first = r.first_token if r.first_token is not None else (r.finished or end)
        scheduled = r.scheduled if r.scheduled is not None else first
        parent.done("queue", r.arrived, scheduled, choice)
        parent.done("prefill", scheduled, first, {**choice, "wafer.prompt_tokens": len(r.prompt_ids)})
        if r.first_token is not None:
            parent.done("decode", r.first_token, r.finished if r.finished is not None else end, choice)
