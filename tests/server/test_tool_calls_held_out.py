"""Tool calls that always parse: held-out schemas at the default temperature, with max_tokens from
the length of the shortest valid call up to 200, streamed and not; bare calls; parallel calls."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.serving import MODEL
from tests.server.test_tools import collect_stream
from wafer.engine.compute_threads import release_compute_threads
from wafer.server.tools import CallParser, parse_reply, tool_grammar

pytestmark = pytest.mark.heavy

# Schemas unlike the ones the grammar was tuned on: open objects (no additionalProperties), free
# strings with no maxLength, nesting, optional keys, pydantic-style $defs.
HELD_OUT = [
    ({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
     {"query": ""}),
    ({"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                       "body": {"type": "string"}}, "required": ["to", "subject", "body"]},
     {"to": "", "subject": "", "body": ""}),
    ({"type": "object", "properties": {"config": {"type": "object", "properties": {
        "name": {"type": "string"}, "retries": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["name"]}}, "required": ["config"]},
     {"config": {"name": ""}}),
    ({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}, "minItems": 1}}, "required": ["items"]},
     {"items": [{"sku": "", "qty": 1}]}),
    ({"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]}, "note": {"type": "string"}},
      "required": ["level"]},
     {"level": "low"}),
    ({"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                          "required": ["x", "y"]}},
      "type": "object", "properties": {"start": {"$ref": "#/$defs/Point"}, "label": {"type": "string"}},
      "required": ["start", "label"]},
     {"start": {"x": 0, "y": 0}, "label": ""}),
]
NAMES = ["search", "send_email", "configure", "order", "set_level", "mark"]
PROMPTS = ["Search the web for the tallest mountain.", "Email bob@example.com that the meeting moved to 3pm.",
           "Configure the service called api with 3 retries.", "Order two of sku B12 and one of sku C3.",
           "Set the alarm level to high, it is urgent.", "Mark the start at 4, 5 and call it home."]


def tool(k: int) -> dict:
    return {"type": "function", "function": {"name": NAMES[k], "description": PROMPTS[k].split(".")[0],
                                             "parameters": HELD_OUT[k][0]}}


def no_extra_keys(value, schema: dict, defs: dict) -> None:
    """Objects carry only the keys their schema lists: arguments are generated closed."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].split("/")[-1]]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(value) <= set(props), f"keys {set(value) - set(props)} are not in the schema"
        for k, v in value.items():
            no_extra_keys(v, props[k], defs)
    elif isinstance(value, list) and "items" in schema:
        for v in value:
            no_extra_keys(v, schema["items"], defs)


@pytest.fixture(scope="module")
def shortest(server) -> list[int]:
    """Tokens in the shortest valid call of each tool: the bare call of its least arguments."""
    tok = server.served.tokenizer
    out = []
    for k, (_, least) in enumerate(HELD_OUT):
        text = json.dumps({"name": NAMES[k], "arguments": least}, separators=(",", ":"))
        out.append(len(tok.encode(text, add_special_tokens=False)))
    return out


def plan(shortest: list[int], n: int = 200) -> list[dict]:
    """n requests: every tool, both choices, half streamed, max_tokens spread from each tool's
    shortest call to 200 (half of them in the tight first 24 tokens above it)."""
    reqs = []
    for i in range(n):
        k = i % len(HELD_OUT)
        low = shortest[k]
        span = 24 if i % 4 < 2 else 200 - low
        max_tokens = min(200, low + (i * 7919) % (span + 1))
        choice = "required" if i % 3 else "auto"
        reqs.append({"k": k, "stream": bool(i % 2), "kwargs": dict(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[k]}],
            tools=[tool(k), tool((k + 1) % len(HELD_OUT))], tool_choice=choice, max_tokens=max_tokens, seed=i,
            parallel_tool_calls=i % 5 == 0)})  # one call ends the reply, which keeps the run short
    return reqs


def send_all(server, reqs: list[dict]) -> list[dict]:
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
        sem = asyncio.Semaphore(16)

        async def one(r):
            async with sem:
                if r["stream"]:
                    return await collect_stream(client, r["kwargs"])
                ch = (await client.chat.completions.create(**r["kwargs"])).choices[0]
                calls = [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in ch.message.tool_calls or []]
                return {"content": ch.message.content or "", "calls": calls, "finish_reason": ch.finish_reason}

        try:
            return await asyncio.gather(*(one(r) for r in reqs))
        finally:
            await client.close()

    return asyncio.run(main())


@pytest.mark.timeout(900)
def test_two_hundred_held_out_calls_parse_and_validate(server, shortest):
    reqs = plan(shortest)
    results = send_all(server, reqs)
    by_name = {NAMES[k]: HELD_OUT[k][0] for k in range(len(HELD_OUT))}
    n_calls = 0
    for r, res in zip(reqs, results):
        where = f"request {reqs.index(r)} (max_tokens {r['kwargs']['max_tokens']}, {r['kwargs']['tool_choice']})"
        assert "<tool_call>" not in res["content"] and "</tool_call>" not in res["content"], where
        assert '"arguments"' not in res["content"], f"{where}: a call leaked into content: {res['content']!r}"
        if r["kwargs"]["tool_choice"] == "required":
            assert res["calls"], f"{where}: no call: {res}"
        if not r["kwargs"]["parallel_tool_calls"]:
            assert len(res["calls"]) <= 1, where
        for call in res["calls"]:
            schema = by_name[call["name"]]
            args = json.loads(call["arguments"])
            jsonschema.validate(args, schema)
            no_extra_keys(args, schema, schema.get("$defs", {}))
            n_calls += 1
    assert n_calls >= 130  # every `required` answer has one, and then some


def test_max_tokens_exactly_the_shortest_call(server, shortest):
    """At the very limit only the shortest completion is left, and it parses."""
    reqs = [{"k": k, "stream": s, "kwargs": dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[k]}],
                                                 tools=[tool(k)], tool_choice="required", max_tokens=shortest[k],
                                                 seed=s)}
            for k in range(len(HELD_OUT)) for s in (0, 1)]
    for r, res in zip(reqs, send_all(server, reqs)):
        (call,) = res["calls"]
        jsonschema.validate(json.loads(call["arguments"]), HELD_OUT[r["k"]][0])


def test_a_complete_call_survives_a_second_one_cut_short():
    """The model writes a call, starts another, and hits max_tokens: the complete one comes back as
    a call, the cut one is dropped, and nothing of either shows as content."""
    text = ('<tool_call>{"name":"search","arguments":{"query":"mountains"}}</tool_call>\n'
            '<tool_call>{"name":"search","arguments":{"query":"riv')
    content, calls, dropped = parse_reply(text)
    assert content is None and dropped
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("search", '{"query":"mountains"}')]
    deltas = []
    parser = CallParser()
    for i in range(0, len(text), 3):
        deltas += parser.feed(text[i : i + 3], final=i + 3 >= len(text))
    assert not any("content" in d for d in deltas)
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas] == ['{"query":"mountains"}']
    content, calls, dropped = parse_reply('{"name":"search","argum')  # a bare call cut before its arguments
    assert content is None and not calls and dropped


@pytest.mark.parametrize("text", [
    '{"name": "get_stock", "arguments": {"sku":"7"}}',  # the arguments are generated compact
    '{"name":"get_stock","arguments":{"sku":"7"}}',
    '\n{\n  "name": "get_stock",\n  "arguments": {"sku":"7"}\n}',
    '```json\n{\n  "name": "get_stock",\n  "arguments": {"sku":"7"}\n}\n```',
])
def test_bare_json_calls_are_recognised(text, server):
    """As Qwen2.5-Coder-0.5B writes them: no tags, maybe laid out, maybe in a ```json block. The grammar
    of `auto` takes the call (and holds it to its schema), and the parser returns it as a call,
    whole and streamed a character at a time."""
    tools = [{"type": "function", "function": {"name": "get_stock", "parameters": {
        "type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}}]
    constraints = server.engine.constraints
    m = constraints.matcher(tool_grammar(tools, "auto", True))
    ids = server.served.tokenizer.encode(text, add_special_tokens=False)
    assert m.validate_tokens(ids) == len(ids)
    bad = server.served.tokenizer.encode('{"name": "get_stock", "arguments": {"sku":"7","extra":1}}',
                                         add_special_tokens=False)
    assert constraints.matcher(tool_grammar(tools, "auto", True)).validate_tokens(bad) < len(bad)
    content, calls, dropped = parse_reply(text)
    assert content is None and not dropped
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_stock", {"sku": "7"})]
    parser, deltas = CallParser(), []
    for i, ch in enumerate(text):
        deltas += parser.feed(ch, final=i == len(text) - 1)
    assert [d for d in deltas if "content" in d] == []
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_stock"]


def test_text_that_merely_starts_with_a_brace_stays_text(server):
    """The judgement call, as llama.cpp's Hermes/Qwen handler: `{"name"` opens a call, any other text
    (JSON included) is content."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = '{"city": "Paris"} is a JSON object.'
    ids = server.served.tokenizer.encode(text, add_special_tokens=False)
    assert server.engine.constraints.matcher(tool_grammar(tools, "auto", True)).validate_tokens(ids) == len(ids)
    assert parse_reply(text) == (text, [], False)


def test_parallel_calls(server):
    """With parallel_tool_calls the grammar takes a second call and both come back, in order, whole
    and streamed; without, a second call is refused."""
    tools = [tool(0), tool(4)]
    two = ('<tool_call>{"name":"search","arguments":{"query":"a"}}</tool_call>\n'
           '<tool_call>{"name":"set_level","arguments":{"level":"high"}}</tool_call>')
    tok = server.served.tokenizer
    ids = tok.encode(two, add_special_tokens=False)
    for choice in ("auto", "required"):
        assert server.engine.constraints.matcher(tool_grammar(tools, choice, True)).validate_tokens(ids) == len(ids)
        assert server.engine.constraints.matcher(tool_grammar(tools, choice, False)).validate_tokens(ids) < len(ids)
    _, calls, _ = parse_reply(two)
    assert [c["function"]["name"] for c in calls] == ["search", "set_level"]
    assert len({c["id"] for c in calls}) == 2
    parser, deltas = CallParser(), []
    for i in range(0, len(two), 5):
        deltas += parser.feed(two[i : i + 5], final=i + 5 >= len(two))
    assert [(d["tool_calls"][0]["index"], d["tool_calls"][0]["function"]["name"]) for d in deltas] == [
        (0, "search"), (1, "set_level")]


def test_parallel_calls_from_the_model(server):
    """The served model asked for two things at once: with parallel calls on, the calls it writes,
    every one valid, ending when it ends (SmolLM2-135M writes one and stops; the grammar once held a
    reply that went on past `</tool_call>` with a newline to another call, which is how sol came to
    write eight for a question that needed two); with parallel calls off, exactly one. The twelve
    requests are sent together (send_all), as the tests above send theirs: each has its own seed, and
    the engine's batches give each sequence what it gets alone (test_concurrency.py)."""
    release_compute_threads()  # as the client fixture does: the server's thread computes
    tools = [tool(0), tool(4)]
    reqs = [{"parallel": parallel, "stream": False, "kwargs": dict(
                model=MODEL, messages=[{"role": "user", "content": "Search for flights to Oslo, and set the "
                                                                   "alarm level to high."}],
                tools=tools, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120, seed=seed)}
            for parallel in (True, False) for seed in range(6)]
    counts = {True: [], False: []}
    for r, res in zip(reqs, send_all(server, reqs)):
        for c in res["calls"]:
            jsonschema.validate(json.loads(c["arguments"]), HELD_OUT[NAMES.index(c["name"])][0])
        counts[r["parallel"]].append(len(res["calls"]))
    assert min(counts[True]) >= 1 and max(counts[True]) <= 2, counts  # never calls beyond what was asked
    assert max(counts[False]) == 1 and min(counts[False]) == 1, counts
