"""Tool calls and structured output that are valid by construction, from the default model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from pydantic import BaseModel

from tests.serving import MODEL

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city", "unit"], "additionalProperties": False},
    # Fractional numbers carry multipleOf: with single-digit tokens a small model can otherwise spin
    # out decimals until max_tokens (bounded strings and arrays, likewise).
    {"type": "object", "properties": {"a": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5},
                                      "b": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 130}},
                 "required": ["name", "age"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
     "required": ["user", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 30},
                                      "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                                "multipleOf": 0.01}},
     "required": ["flag", "score"], "additionalProperties": False},
]
QUESTIONS = ["What's the weather like in Paris?", "Add two numbers for me.", "Make a short shopping list.",
             "Register a new user called Ana.", "Rate this idea: a flying bicycle.", "Help me with my task."]


def run_batch(server, make_kwargs, check, n: int = 50) -> None:
    """Send n requests (half of them streamed), 8 at a time, and check each result."""
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        sem = asyncio.Semaphore(8)

        async def one(i: int):
            kwargs = make_kwargs(i)
            async with sem:
                if i % 2:
                    return i, await collect_stream(client, kwargs)
                r = await client.chat.completions.create(**kwargs)
                return i, r.choices[0]

        results = await asyncio.gather(*(one(i) for i in range(n)))
        await client.close()
        return results

    for i, result in asyncio.run(main()):
        check(i, result)


async def collect_stream(client, kwargs):
    """Rebuild the message from chunks exactly as OpenAI clients do."""
    stream = await client.chat.completions.create(**kwargs, stream=True)
    content, calls, finish = "", {}, None
    async for chunk in stream:
        ch = chunk.choices[0]
        if ch.delta.content:
            content += ch.delta.content
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name  # first delta of an index
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return {"content": content, "calls": [calls[k] for k in sorted(calls)], "finish_reason": finish}


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i % len(SCHEMAS)}", "description": "Does a thing.",
                                             "parameters": SCHEMAS[i % len(SCHEMAS)]}}


def test_fifty_required_tool_calls_validate(server):
    def kwargs(i):
        return dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    tools=[tool(i), tool(i + 1)], tool_choice="required", parallel_tool_calls=False,
                    max_tokens=300, temperature=0.8, seed=i)

    def check(i, result):
        if isinstance(result, dict):
            calls, content, finish = result["calls"], result["content"], result["finish_reason"]
            calls = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
        else:
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in result.message.tool_calls]
            content, finish = result.message.content, result.finish_reason
        assert finish == "tool_calls" and not content  # tool-call text never leaks into content
        assert len(calls) == 1
        names = {f"tool_{i % len(SCHEMAS)}": SCHEMAS[i % len(SCHEMAS)],
                 f"tool_{(i + 1) % len(SCHEMAS)}": SCHEMAS[(i + 1) % len(SCHEMAS)]}
        jsonschema.validate(json.loads(calls[0]["arguments"]), names[calls[0]["name"]])

    run_batch(server, kwargs, check)


def test_fifty_json_schema_responses_validate(server):
    def kwargs(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        return dict(model=MODEL, messages=[{"role": "user", "content": "Answer in JSON. " + QUESTIONS[i % 6]}],
                    response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                            "strict": True}},
                    max_tokens=300, temperature=0.8, seed=100 + i)

    def check(i, result):
        content = result["content"] if isinstance(result, dict) else result.message.content
        finish = result["finish_reason"] if isinstance(result, dict) else result.finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(content), SCHEMAS[i % len(SCHEMAS)])

    run_batch(server, kwargs, check)


def test_json_object_mode(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                       response_format={"type": "json_object"}, max_tokens=300, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_named_tool_choice_makes_exactly_that_one_call(client):
    """A named function forces one call of it, parallel calls or not (tests of several calls are in
    test_tool_calls_held_out.py)."""
    tools = [tool(0), tool(1)]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=tools, tool_choice={"type": "function", "function": {"name": "tool_1"}},
                                       max_tokens=120)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "tool_1" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[1])


def test_auto_may_answer_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       tools=[tool(0)], tool_choice="auto", max_tokens=30, temperature=0)
    c = r.choices[0]
    assert (c.message.content and not c.message.tool_calls) or (c.message.tool_calls and c.finish_reason ==
                                                                 "tool_calls")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       tools=[tool(0)], tool_choice="none", max_tokens=10, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_tool_results_in_history(client):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "tool_0", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool(0)], tool_choice="none",
                                       max_tokens=40, temperature=0)
    assert r.choices[0].message.content


class Person(BaseModel):
    name: str
    age: int
    hobbies: list[str]


def test_sdk_parse_with_pydantic(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, max_tokens=150, temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_openai_agents_sdk_end_to_end(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"The weather in {city} is 21 degrees and sunny."

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Use the tool to answer weather questions.",
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        tools=[get_weather],
        # Greedy and one call at a time: the assertions below are about the wire, not about sampling.
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=100, temperature=0,
                                            parallel_tool_calls=False),
        tool_use_behavior="stop_on_first_tool",
    )
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, "What's the weather in Lisbon?", max_turns=3))
    assert len(calls) == 1
    assert result.final_output == f"The weather in {calls[0]} is 21 degrees and sunny."


def test_tool_schema_with_refs_into_defs(client):
    """pydantic writes nested arguments as `$ref` into the schema's own `$defs` (the Agents SDK and
    pydantic-ai send such schemas); two tools may even use the same definition names."""

    class Item(BaseModel):
        sku: str
        quantity: int

    class Order(BaseModel):
        item: Item
        note: str

    class Other(BaseModel):
        item: Item

    order, other = Order.model_json_schema(), Other.model_json_schema()
    assert "$defs" in order and "$ref" in json.dumps(order["properties"])
    tools = [{"type": "function", "function": {"name": "place_order", "parameters": order}},
             {"type": "function", "function": {"name": "other", "parameters": other}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Order 3 of sku A7."}],
                                       tools=tools, tool_choice={"type": "function", "function": {"name": "place_order"}},
                                       max_tokens=120, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), order)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Order 3 of sku A7."}],
                                       tools=tools, tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), order if call.function.name == "place_order" else other)


def _strict_json(text: str):
    """JSON as a strict parser reads it: `NaN`, `Infinity` and `-Infinity` are not JSON."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_under_a_grammar_are_strict_json(server, stream):
    """The tokens a grammar masks out have logprob minus infinity; where they show among
    top_logprobs, they are reported as -9999.0 (as vLLM does), so that the reply, whole or streamed,
    is JSON that strict parsers read."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
            "response_format": {"type": "json_object"}, "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "stream": stream}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        events = [_strict_json(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        content = [c for e in events for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    else:
        content = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    tops = [t["logprob"] for c in content for t in c["top_logprobs"]]
    assert content and -9999.0 in tops  # a grammar step with fewer than 5 allowed tokens was reported
    assert all(-9999.0 <= v <= 0 for v in tops + [c["logprob"] for c in content])


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
BARE_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize("where", ["tools", "response_format"])
@pytest.mark.parametrize("schema", [RECURSIVE, BARE_CYCLE], ids=["recursive required $ref", "bare $ref cycle"])
def test_a_schema_no_reply_could_complete_is_refused_up_front(client, where, schema):
    """Its grammar could never be completed, and its masks held every step for a second or more."""
    import openai

    if where == "tools":
        kw = dict(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}], tool_choice="required")
        param = "tools[0].function.parameters"
    else:
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        param = "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go."}], max_tokens=20, **kw)
    assert e.value.body["param"] == param and "admits no finite value" in e.value.body["message"]


# Recursive where no up-front check sees it (at least one key, and the one key allowed holds the
# object again): llguidance's limits on a step's work stop its matcher at run time.
ENDLESS_AT_RUN_TIME = {"type": "object", "patternProperties": {"^a$": {"$ref": "#"}}, "minProperties": 1,
                       "additionalProperties": False}


def test_a_schema_too_costly_to_follow_ends_alone_with_a_400_its_neighbours_unaffected(server, aclient):
    """Whole, a 400 with code grammar_too_costly; streamed, the same error as the stream's last event
    (the 200 was sent); four neighbour streams beside them each run to their end."""
    import httpx
    import openai

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a cat as JSON."}], "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS_AT_RUN_TIME}}}

    async def neighbour():
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        return [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices][-1]

    async def costly():
        with pytest.raises(openai.BadRequestError) as e:
            await aclient.chat.completions.create(**body)
        assert e.value.body["code"] == "grammar_too_costly" and "llguidance stopped it" in e.value.body["message"]
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.status_code == 200 and events[-1]["error"]["code"] == "grammar_too_costly", r.text

    async def both():
        return await asyncio.gather(costly(), *(neighbour() for _ in range(4)))

    _, *finishes = asyncio.run(both())
    assert finishes == ["length"] * 4
    # Each step's grammar time is on /metrics, for the fuzz bench's "no step over 100 ms" to read.
    metrics = httpx.get(server.base_url + "/metrics").text
    for name in ("wafer:grammar_mask_seconds", "wafer:grammar_mask_cpu_seconds"):
        counts = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + "_count{")]
        assert counts and sum(counts) > 0, name


def test_calls_as_the_model_lays_them_out_and_the_end_after_them(server):
    """The grammar takes a call's arguments as the model writes them (`{"city": "Paris"}`, spaced, or
    on indented lines in a ```json block), and lets the reply end after the newline that follows its
    last call, rather than holding it to another call."""
    from wafer.server.tools import tool_grammar

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}]
    replies = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n',
               '```json\n{\n    "name": "get_weather",\n    "arguments": {\n        "city": "Paris"\n    }\n}\n```\n']
    tok = server.served.tokenizer
    for choice in ("auto", "required"):
        for text in replies:
            m = server.engine.constraints.matcher(tool_grammar(tools, choice, True))
            ids = tok.encode(text, add_special_tokens=False)
            assert m.validate_tokens(ids) == len(ids), (choice, text)
            m.consume_tokens(ids)
            assert m.is_accepting(), (choice, text)
    bad = tok.encode('{"name": "get_weather", "arguments": {"city": "Paris", "when": "now"}}', add_special_tokens=False)
    m = server.engine.constraints.matcher(tool_grammar(tools, "auto", True))
    assert m.validate_tokens(bad) < len(bad)  # still closed to the schema's keys


def test_strict_closes_every_object(server):
    """`strict: true`, in `response_format` or on a tool, holds every object to its listed keys, as
    OpenAI's strict mode does, even one that says `additionalProperties: true` or says nothing
    (pydantic's schemas don't)."""
    from wafer.server.tools import closed, json_grammar, tool_grammar

    schema = {"type": "object", "properties": {"country": {"type": "string"}, "info": {
        "type": "object", "properties": {"capital": {"type": "string"}}, "additionalProperties": True}},
        "required": ["country"]}
    assert closed(schema, strict=True)["additionalProperties"] is False
    assert closed(schema, strict=True)["properties"]["info"]["additionalProperties"] is False
    assert closed(schema)["properties"]["info"]["additionalProperties"] is True  # said so, without strict
    tok, constraints = server.served.tokenizer, server.engine.constraints
    extra = tok.encode('{"country":"India","capital_city":"Delhi"}', add_special_tokens=False)
    nested = tok.encode('{"country":"India","info":{"capital":"Delhi","size":3}}', add_special_tokens=False)
    assert constraints.matcher(json_grammar(schema)).validate_tokens(extra) == len(extra)  # open without strict
    for text in (extra, nested):
        assert constraints.matcher(json_grammar(schema, strict=True)).validate_tokens(text) < len(text)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    call = tok.encode('{"name": "f", "arguments": {"country": "India", "info": {"capital": "Delhi", "size": 3}}}',
                      add_special_tokens=False)
    assert constraints.matcher(tool_grammar([tool], "required", False)).validate_tokens(call) < len(call)
