"""OpenTelemetry traces (wafer/tracing.py): the official SDK against a real server whose spans go to
an in-memory exporter; a request's span with the GenAI attributes, its children (queueing, the
prompt steps, decoding; an Ultra response's agents and turns), parented under an incoming
`traceparent`; and with tracing off, no span object made at all."""

from __future__ import annotations

import json
import time

import openai
import pytest
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.agents.scripted import ScriptedChat
from tests.serving import MODEL, start_server
from wafer import tracing
from wafer.agents.responses import ResponsesService
from wafer.agents.sandbox import check_sandbox
from wafer.agents.store import ResponseStore

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def traced(smollm, tmp_path_factory):
    exporter = InMemorySpanExporter()
    server = start_server(smollm, tracer=tracing.Tracing(exporter=exporter),
                          state_db=tmp_path_factory.mktemp("state") / "state.db")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client, exporter
    server.stop()


def finished(exporter: InMemorySpanExporter, name_start: str, timeout: float = 10.0) -> list:
    """The spans exported once a root-level span whose name starts with `name_start` has ended (the
    request's span ends after its response is sent, so a moment after the client has it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = exporter.get_finished_spans()
        if any(s.name.startswith(name_start) and s.kind.name == "SERVER" for s in spans):
            return list(spans)
        time.sleep(0.02)
    raise AssertionError(f"no span {name_start!r} in {[s.name for s in exporter.get_finished_spans()]}")


def children(spans: list, parent) -> list:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_a_chat_completion_is_a_span_under_the_callers_trace_with_its_engine_work(traced):
    client, exporter = traced
    exporter.clear()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
                                       temperature=0.0, extra_headers={"traceparent": TRACEPARENT})
    spans = finished(exporter, "chat ")
    root = next(s for s in spans if s.kind.name == "SERVER")
    assert root.name == f"chat {MODEL}"
    # under the caller's span, in the caller's trace
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert list(a["gen_ai.response.finish_reasons"]) == [r.choices[0].finish_reason]
    assert a["http.response.status_code"] == 200
    kids = {s.name: s for s in children(spans, root)}
    assert set(kids) == {"queue", "prefill", "decode"}
    # one after another, within the request's span
    q, p, d = kids["queue"], kids["prefill"], kids["decode"]
    assert root.start_time <= q.start_time <= q.end_time <= p.start_time + 1_000 <= p.end_time + 1_000
    assert p.end_time <= d.start_time + 1_000 and d.end_time <= root.end_time
    assert p.attributes["wafer.prompt_tokens"] == r.usage.prompt_tokens


def test_a_streamed_completion_has_its_usage_and_a_new_trace_without_traceparent(traced):
    client, exporter = traced
    exporter.clear()
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True,
                                       stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    spans = finished(exporter, "text_completion ")
    root = next(s for s in spans if s.kind.name == "SERVER")
    assert root.parent is None  # no traceparent: a trace of its own
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 5
    assert list(root.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert {s.name for s in children(spans, root)} == {"queue", "prefill", "decode"}
    assert all(s.end_time <= root.end_time for s in children(spans, root))


def test_a_bad_request_is_a_failed_span(traced):
    client, exporter = traced
    exporter.clear()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    root = next(s for s in finished(exporter, "chat") if s.kind.name == "SERVER")
    assert root.attributes["http.response.status_code"] == 404
    assert root.status.status_code.name == "ERROR"


def test_a_responses_turn_is_a_chat_span_under_the_response(traced):
    client, exporter = traced
    exporter.clear()
    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6,
                                extra_headers={"traceparent": TRACEPARENT})
    spans = finished(exporter, "invoke_agent ")
    root = next(s for s in spans if s.kind.name == "SERVER")
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.attributes["gen_ai.response.id"] == r.id
    assert root.attributes["gen_ai.usage.output_tokens"] == r.usage.output_tokens
    turn, = children(spans, root)
    assert turn.name == f"chat {MODEL}" and turn.attributes["gen_ai.agent.name"] == "root"
    assert turn.attributes["gen_ai.usage.output_tokens"] == r.usage.output_tokens
    assert {s.name for s in children(spans, turn)} == {"queue", "prefill", "decode"}


@pytest.fixture(scope="module")
def scripted(smollm, tmp_path_factory):
    """A traced server whose Responses API's model turns the test writes."""
    exporter = InMemorySpanExporter()
    script = ScriptedChat([])
    service = ResponsesService(script, ResponseStore(tmp_path_factory.mktemp("state") / "state.db"))
    server = start_server(smollm, responses=service, tracer=tracing.Tracing(exporter=exporter))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client, script, exporter
    server.stop()


def test_ultras_subagents_are_spans_under_the_request_with_their_turns_and_tool_calls(scripted):
    client, script, exporter = scripted
    exporter.clear()

    def turn(body):  # the plan, each agent's turn (agent_2 calls a tool), the synthesis
        if body.get("response_format"):
            return json.dumps({"subtasks": ["part one", "part two"]})
        text = json.dumps(body["messages"])
        if "You are agent_2" in text:
            return [("get_weather", {"city": "Oslo"})]
        return "done"

    script.policy = turn
    try:
        weather = {"type": "function", "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}
        client.responses.create(model=MODEL, input="Weather in two cities.", tools=[weather],
                                extra_body={"multi_agent": {"enabled": True, "max_concurrent_subagents": 2}},
                                extra_headers={"traceparent": TRACEPARENT})
    finally:
        script.policy = None
    spans = finished(exporter, "invoke_agent ")
    root = next(s for s in spans if s.kind.name == "SERVER")
    assert root.attributes["gen_ai.agent.name"] == "ultra"
    kids = children(spans, root)
    agents = {s.attributes["gen_ai.agent.name"]: s for s in kids if s.name.startswith("invoke_agent")}
    assert set(agents) == {"agent_1", "agent_2"}
    assert [s.attributes["gen_ai.agent.name"] for s in kids if s.name.startswith("chat")] == ["root"]  # the plan
    for name, agent in agents.items():
        turns = children(spans, agent)
        assert [t.name for t in turns] == [f"chat {MODEL}"], name
        assert all(t.attributes["gen_ai.agent.name"] == name for t in turns)
    tool, = [s for s in spans if s.name == "execute_tool get_weather"]
    assert tool.attributes["gen_ai.tool.call.id"].startswith("call_")
    assert tool.parent.span_id == children(spans, agents["agent_2"])[0].context.span_id
    assert all(s.context.trace_id == root.context.trace_id for s in spans)


@pytest.mark.skipif(check_sandbox() is not None, reason=f"no sandbox here: {check_sandbox()}")
def test_a_program_is_a_span_under_its_turn_with_the_calls_it_makes_under_it(scripted):
    client, script, exporter = scripted
    exporter.clear()
    code = 'reply = await get_stock(sku="a")\ntext(str(reply))'
    script.turns[:] = [[("run_program", {"code": code})]]
    tools = [{"type": "programmatic_tool_calling"},
             {"type": "function", "name": "get_stock", "parameters": {"type": "object", "properties": {
                 "sku": {"type": "string"}}}, "allowed_callers": ["programmatic"]}]
    r = client.responses.create(model=MODEL, input="Stock of a?", tools=tools)
    assert r.output[-1].type == "function_call"  # the program waits on the client's get_stock
    spans = finished(exporter, "invoke_agent ")
    root = next(s for s in spans if s.kind.name == "SERVER")
    turn, = children(spans, root)
    program, = children(spans, turn)
    assert program.name == "execute_tool run_program"
    assert program.attributes["gen_ai.tool.call.id"] == r.output[0].call_id
    call, = children(spans, program)
    assert call.name == "execute_tool get_stock" and call.attributes["wafer.tool.caller"] == "program"


def test_with_tracing_off_no_span_is_made(server, client, monkeypatch):
    made = []
    for cls in (SdkSpan, tracing.Span):
        def counted(self, *a, _init=cls.__init__, **k):  # type: ignore[no-untyped-def]
            made.append(self)
            _init(self, *a, **k)

        monkeypatch.setattr(cls, "__init__", counted)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   extra_headers={"traceparent": TRACEPARENT})
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True)
    assert len(list(stream)) > 0
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert made == []
    # and the count does see spans where there are some
    tracing.Tracing(exporter=InMemorySpanExporter()).request("chat", {}).end()
    assert len(made) == 2


def test_the_endpoint_comes_from_the_flag_then_the_standard_variables():
    assert tracing.endpoint_of(None, {}) is None
    assert tracing.endpoint_of("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert tracing.endpoint_of("http://c:4318/v1/traces", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) == \
        "http://c:4318/v1/traces"
    assert tracing.endpoint_of(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318/"}) == "http://x:4318/v1/traces"
    assert tracing.endpoint_of(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                                      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://y/traces"}) == "http://y/traces"


def test_the_spans_reach_an_otlp_http_collector_as_protobuf():
    """The real exporter: a collector on loopback receives the span, OTLP/HTTP protobuf at /v1/traces."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # type: ignore[no-untyped-def]
            body = self.rfile.read(int(self.headers["content-length"]))
            got.append((self.path, self.headers["content-type"], ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):  # type: ignore[no-untyped-def]
            pass

    http = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        t = tracing.Tracing(tracing.endpoint_of(f"http://127.0.0.1:{http.server_port}"))
        span = t.request("chat", {"traceparent": TRACEPARENT})
        span.set({tracing.REQUEST_MODEL: MODEL})
        span.end()
        t.shutdown()  # sends the batch
    finally:
        http.shutdown()
    (path, kind, sent), = got
    assert path == "/v1/traces" and kind == "application/x-protobuf"
    s, = sent.resource_spans[0].scope_spans[0].spans
    assert s.name == "chat" and s.trace_id.hex() == TRACE_ID and s.parent_span_id.hex() == PARENT_ID
    assert {a.key: a.value.string_value for a in s.attributes}[tracing.REQUEST_MODEL] == MODEL
    service = {a.key: a.value.string_value for a in sent.resource_spans[0].resource.attributes}["service.name"]
    assert service == "wafer"
