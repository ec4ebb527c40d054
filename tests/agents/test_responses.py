"""`/v1/responses` against the `openai` SDK's types, on the bundled model (greedy) and on a scripted
one where the test must see what the model was sent."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading

import httpx
import openai
import pytest

from tests.agents.scripted import ScriptedChat
from tests.serving import start_server
from wafer.agents.responses import ResponsesService
from wafer.agents.store import ResponseStore

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# A call a program made, and its output, as a client could forge them.
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}


def stored(db) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("select count(*) from responses").fetchone()[0]


@pytest.fixture(scope="module")
def real(smollm, tmp_path_factory):
    db = tmp_path_factory.mktemp("state") / "state.db"
    server = start_server(smollm, names=[MODEL], state_db=db)
    yield server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120), db
    server.stop()


@pytest.fixture(scope="module")
def scripted(smollm, tmp_path_factory):
    script = ScriptedChat([])
    service = ResponsesService(script, ResponseStore(tmp_path_factory.mktemp("state") / "state.db"),
                               prices={MODEL: {"input": 2.0, "output": 10.0}})
    server = start_server(smollm, names=[MODEL], responses=service)
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60), script
    server.stop()


def test_a_response_and_its_usage(real):
    _, client, _ = real
    r = client.responses.create(model=MODEL, input="What is the capital of Japan?", temperature=0,
                                max_output_tokens=40)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert "Tokyo" in r.output_text
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 40
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_streamed_events_in_order_add_up_to_the_response(real):
    _, client, _ = real
    with client.responses.stream(model=MODEL, input="Name three colours, in one short sentence.", temperature=0,
                                 max_output_tokens=300) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    assert client.responses.retrieve(final.id).output_text == text


def test_max_output_tokens_makes_it_incomplete(real):
    _, client, _ = real
    r = client.responses.create(model=MODEL, input="Write a long story about a cat.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_previous_response_id_carries_the_conversation_across_a_restart(smollm, tmp_path):
    db = tmp_path / "state.db"

    def turn(**kw):  # type: ignore[no-untyped-def]
        server = start_server(smollm, names=[MODEL], state_db=db)  # a server of its own, stopped after
        try:
            c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            return c.responses.create(model=MODEL, temperature=0, max_output_tokens=30, **kw), c
        finally:
            server.stop()

    first, _ = turn(input="My name is Ada. Remember it.")
    second, _ = turn(input="What is my name?", previous_response_id=first.id)
    # The second server read the first turn back from the store: its input and output are in the prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    server = start_server(smollm, names=[MODEL], state_db=db)
    try:
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        items = c.responses.input_items.list(second.id, order="asc")
        assert [i.type for i in items.data] == ["message"]
        assert items.data[0].content[0].text == "What is my name?"
        assert c.responses.retrieve(first.id).output_text == first.output_text
    finally:
        server.stop()


def test_store_false_keeps_nothing(real):
    _, client, _ = real
    r = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="again", previous_response_id=r.id, max_output_tokens=5)
    assert e.value.body["param"] == "previous_response_id"


def test_delete_and_input_items(real):
    _, client, _ = real
    r = client.responses.create(model=MODEL, max_output_tokens=5, input=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "input_text", "text": "two"}]}])
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.role for i in page.data] == ["developer", "user"] and page.has_more
    rest = client.responses.input_items.list(r.id, after=page.data[-1].id, order="asc")
    assert [i.role for i in rest.data] == ["assistant", "user"] and not rest.has_more
    newest = client.responses.input_items.list(r.id, limit=1)
    assert newest.data[0].content[0].text == "two"
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found"


def test_a_json_schema_answer(real):
    _, client, _ = real
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="The capital of Japan, as JSON.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                 "strict": True}})
    assert set(json.loads(r.output_text)) == {"city", "country"}


@pytest.mark.parametrize("body, param", [
    ({"input": "hi"}, "model"),
    ({"model": MODEL, "input": [{"type": "bogus"}]}, "input[0].type"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": MODEL, "input": "hi", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"model": MODEL, "input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
     "tool_choice"),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "hi", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "input": "hi", "previous_response_id": "resp_nothing"}, "previous_response_id"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "msg_nothing"}]}, "input[0].id"),
    ({"model": MODEL}, "input"),
    # item fields that are not what the API's types say (each was a 500)
    ({"model": MODEL, "input": [{"role": "user", "content": "hi", "id": [1]}]}, "input[0].id"),
    ({"model": "no-such-model", "input": [{"role": "user", "content": "hi", "id": [1]}]}, "input[0].id"),
    ({"model": MODEL, "input": [{"role": "user", "content": "hi", "status": {}}]}, "input[0].status"),
    ({"model": MODEL, "input": [{**CALL, "caller": "x"}, OUTPUT]}, "input[0].caller"),
    ({"model": MODEL, "input": [{**CALL, "caller": {"type": "program"}}, OUTPUT]}, "input[0].caller.caller_id"),
    ({"model": MODEL, "input": [{**CALL, "caller": {"type": "program", "caller_id": [1]}}, OUTPUT]},
     "input[0].caller.caller_id"),
    ({"model": MODEL, "input": [{**CALL, "caller": {"type": "robot"}}, OUTPUT]}, "input[0].caller"),
    # a sub-agent model that nothing serves: refused before the plan's turn, not when the agents start
    ({"model": MODEL, "input": "hi", "multi_agent": {"enabled": True, "subagent_model": "no-such-model"}},
     "multi_agent.subagent_model"),
])
def test_bad_requests_are_openai_shaped_400s(real, body, param):
    server, _, _ = real
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


def test_a_refused_request_stores_nothing(real):
    server, client, db = real
    client.responses.create(model=MODEL, input="hi", max_output_tokens=1)  # makes the table
    before = stored(db)
    r = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": "hi"}, {**CALL, "caller": "x"}, OUTPUT]}, timeout=30)
    assert r.status_code == 400 and stored(db) == before


@pytest.fixture(scope="module")
def a_stored_response(real):
    return real[1].responses.create(model=MODEL, input="hi", max_output_tokens=1).id


# '²' and '١' pass str.isdigit() and not int(); 5,000 digits pass isdigit() and not int() either
@pytest.mark.parametrize("limit", ["\u00b2", "9" * 5000, "0", "101", "-1", "1.5", " 7", "\u0661"])
def test_input_items_limit_is_an_integer_from_1_to_100(real, a_stored_response, limit):
    server, _, _ = real
    r = httpx.get(f"{server.base_url}/v1/responses/{a_stored_response}/input_items", params={"limit": limit},
                  timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "limit"


def test_unknown_model_and_too_long_input(real):
    _, client, _ = real
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="word " * 5000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_function_tools_across_turns(scripted):
    client, script = scripted
    script.bodies.clear()
    script.turns[:] = [[("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
                       "Paris is sunny and Rome is rainy.", "You asked about Paris and Rome."]
    r = client.responses.create(model=MODEL, input="Weather in Paris and Rome?", tools=[WEATHER],
                                instructions="Use tools.")
    calls = [i for i in r.output if i.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"] and r.output_text == ""
    assert all(c.caller is None for c in calls)
    r = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": c.call_id, "output": w}
        for c, w in zip(calls, ["sunny", "rainy"])])
    assert r.output_text == "Paris is sunny and Rome is rainy."
    sent = script.bodies[1]["messages"]
    # instructions do not carry over to the next response (as OpenAI's); the calls are one assistant turn
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    assert [c["function"]["name"] for c in sent[1]["tool_calls"]] == ["get_weather", "get_weather"]
    assert [m["content"] for m in sent[2:]] == ["sunny", "rainy"]
    assert script.bodies[1]["tools"][0]["function"]["name"] == "get_weather"
    # the same conversation, sent as items instead of a previous_response_id
    items = [{"role": "user", "content": "Weather in Paris and Rome?"}, *[c.model_dump(exclude_none=True) for c in calls],
             *[{"type": "function_call_output", "call_id": c.call_id, "output": w}
               for c, w in zip(calls, ["sunny", "rainy"])],
             *[i.model_dump(exclude_none=True) for i in r.output], {"role": "user", "content": "Which cities?"}]
    r = client.responses.create(model=MODEL, input=items, tools=[WEATHER])
    assert r.output_text == "You asked about Paris and Rome."
    assert [m["role"] for m in script.bodies[2]["messages"]] == ["user", "assistant", "tool", "tool", "assistant",
                                                                 "user"]


def test_streamed_function_calls(scripted):
    client, script = scripted
    script.turns[:] = [[("get_weather", {"city": "Oslo"})]]
    with client.responses.stream(model=MODEL, input="Oslo?", tools=[WEATHER]) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = events[4]
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Oslo"}


def test_a_real_model_calls_a_tool(real):
    _, client, _ = real
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=80)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)


def test_each_response_accounts_for_its_turns_and_the_task_so_far(scripted):
    client, script = scripted
    script.turns[:] = [[("get_weather", {"city": "Paris"})], "Sunny."]
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    call = first.output[0]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    a1, a2 = first.model_extra["accounting"], second.model_extra["accounting"]
    for a, r in ((a1, first), (a2, second)):
        (turn,) = a["turns"]
        assert (turn["input_tokens"], turn["output_tokens"]) == (r.usage.input_tokens, r.usage.output_tokens)
        assert turn["model"] == MODEL
        assert a["cost_usd"] == pytest.approx((2.0 * r.usage.input_tokens + 10.0 * r.usage.output_tokens) / 1e6)
    assert a1["tool_calls"] == {"direct": 1, "programmatic": 0} and a2["tool_calls"]["direct"] == 0
    assert a1["mode"] == a2["mode"] == "direct"
    task = a2["task"]
    assert task["responses"] == 2 and task["model_turns"] == 2 and task["tool_calls"] == 1
    assert task["input_tokens"] == first.usage.input_tokens + second.usage.input_tokens
    assert task["cost_usd"] == pytest.approx(a1["cost_usd"] + a2["cost_usd"])
    assert client.responses.retrieve(second.id).model_extra["accounting"]["task"] == task


def test_delete_of_a_streaming_response_ends_its_stream_with_a_terminal_event(scripted):
    client, script = scripted
    started = threading.Event()

    async def hold(body):  # type: ignore[no-untyped-def]
        started.set()
        await asyncio.sleep(3600)  # a turn that would run on for an hour

    script.policy = hold
    base = str(client.base_url)
    try:
        with httpx.stream("POST", base + "responses", json={"model": MODEL, "input": "hi", "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.in_progress":
                        break
            assert started.wait(10)
            rid = events[0]["response"]["id"]
            deleted = httpx.delete(f"{base}responses/{rid}", timeout=10)
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            events += [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    finally:
        script.policy = None
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], events[-3:]
    assert events[-2]["code"] == "response_cancelled"
    assert events[-1]["response"]["status"] == "cancelled" and events[-1]["response"]["id"] == rid
    with pytest.raises(openai.NotFoundError):  # deleted stays deleted: the end of the stream did not store it
        client.responses.retrieve(rid)


def test_a_response_cut_by_shutdown_is_incomplete_interrupted(smollm, tmp_path):
    """Not `max_output_tokens`: the client can tell a cut response from one that ran out of budget."""
    db = tmp_path / "state.db"
    server = start_server(smollm, names=[MODEL], state_db=db)

    def shut_down() -> None:  # what GracefulServer does when its grace period is over (wafer/server/main.py)
        server.served.engine.accepting = False
        server.served.engine.finish_all("length")

    events = []
    try:
        body = {"model": MODEL, "input": "Write a long story about a cat.", "stream": True, "max_output_tokens": 400}
        with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if [e["type"] for e in events].count("response.output_text.delta") == 2:
                        server.server.loop.call_soon_threadsafe(shut_down)
    finally:
        server.stop()
    final = events[-1]
    assert final["type"] == "response.incomplete", [e["type"] for e in events[-3:]]
    assert final["response"]["incomplete_details"] == {"reason": "interrupted"}
    assert final["response"]["usage"]["output_tokens"] < 400
    kept = ResponseStore(db).get(final["response"]["id"])[0]
    assert kept["status"] == "incomplete" and kept["incomplete_details"] == {"reason": "interrupted"}


def test_reasoning_comes_as_a_reasoning_item_before_the_answer(scripted):
    client, script = scripted
    script.turns[:] = [{"reasoning": "two plus two is four", "text": "4"}]
    with client.responses.stream(model=MODEL, input="2+2?", reasoning={"effort": "low"}) as stream:
        events = list(stream)
        r = stream.get_final_response()
    assert script.bodies[-1]["reasoning_effort"] == "low"
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "two plus two is four" and r.output_text == "4"
    assert r.usage.output_tokens_details.reasoning_tokens == 5 and r.usage.output_tokens == 6
    acct = r.model_extra["accounting"]
    assert acct["mode"] == "max" and acct["task"]["reasoning_tokens"] == 5
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "two plus two is four"
    # the next turn does not read the reasoning back
    script.turns[:] = ["ok"]
    client.responses.create(model=MODEL, input="thanks", previous_response_id=r.id)
    assert "two plus two" not in json.dumps(script.bodies[-1]["messages"])
