"""Ultra through `/v1/responses`: a plan of N parts, N sub-agents at once, a synthesis; on a
scripted model where the test must see the turns, and on the bundled model where the engine must
batch the sub-agents together."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from tests.agents.scripted import ScriptedChat
from tests.serving import start_server
from wafer.agents.responses import ResponsesService
from wafer.agents.store import ResponseStore
from wafer.engine.kv_layout import BLOCK

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def agent_of(body) -> str | None:
    """The sub-agent whose turn this is (its first user turn names it), or None for the root's."""
    first = next((m["content"] for m in body["messages"] if m["role"] == "user"), "")
    text = first if isinstance(first, str) else "".join(p.get("text", "") for p in first)
    return text.split("You are ", 1)[1].split(".", 1)[0] if text.startswith("You are agent_") else None


class Team:
    """A policy for every turn of an Ultra response: the plan, each agent's work, the synthesis."""

    def __init__(self, n: int, hold: float = 0.0, fail: str | None = None, tool_agent: str | None = None,
                 holds: dict[str, float] | None = None) -> None:
        self.n, self.hold, self.fail, self.tool_agent = n, hold, fail, tool_agent
        self.holds = holds or {}  # an agent's own hold, where it is not `hold`
        self.in_flight = self.most = 0

    async def __call__(self, body):  # type: ignore[no-untyped-def]
        if body.get("response_format"):
            assert body["response_format"]["json_schema"]["schema"]["properties"]["subtasks"]["maxItems"] == self.n
            return json.dumps({"subtasks": [f"city {k}" for k in range(1, self.n + 1)]})
        agent = agent_of(body)
        if agent is None:
            results = body["messages"][-1]["content"]
            assert results.startswith("Results of the agents")
            return "Summary: " + "; ".join(line for line in results.splitlines() if line.startswith("result of"))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.holds.get(agent, self.hold))
        finally:
            self.in_flight -= 1
        if agent == self.fail:
            raise RuntimeError("this agent broke")
        last = body["messages"][-1]
        if agent == self.tool_agent and last["role"] != "tool":
            return [("get_weather", {"city": "Oslo"})]
        return f"result of {agent}" + (f" with {last['content']}" if last["role"] == "tool" else "")


@pytest.fixture(scope="module")
def scripted(smollm, tmp_path_factory):
    script = ScriptedChat([])
    service = ResponsesService(script, ResponseStore(tmp_path_factory.mktemp("state") / "state.db"))
    server = start_server(smollm, names=[MODEL], responses=service)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    client.service = service  # type: ignore[attr-defined]
    yield client, script
    server.stop()


def test_subagents_run_on_the_configured_model_unless_the_request_names_one(scripted):
    client, script = scripted
    script.policy = Team(2)
    client.service.subagent_model = "luna"
    try:
        script.bodies.clear()
        client.responses.create(model=MODEL + "-ultra", input="Two?", extra_body={"multi_agent": {
            "max_concurrent_subagents": 2}})
        by_agent = {agent_of(b): b["model"] for b in script.bodies}
        assert by_agent == {None: MODEL, "agent_1": "luna", "agent_2": "luna"}
        script.bodies.clear()
        client.responses.create(model=MODEL + "-ultra", input="Two?", extra_body={"multi_agent": {
            "max_concurrent_subagents": 2, "subagent_model": "terra"}})
        assert {agent_of(b): b["model"] for b in script.bodies}["agent_1"] == "terra"
    finally:
        client.service.subagent_model = None
        script.policy = None


def test_plan_agents_and_synthesis(scripted):
    client, script = scripted
    team = script.policy = Team(3, hold=0.3)
    script.bodies.clear()
    r = client.responses.create(model=MODEL, input="Weather in three cities?", tools=[WEATHER],
                                extra_body={"multi_agent": {"enabled": True, "max_concurrent_subagents": 3}})
    assert r.status == "completed"
    agents = [i.model_extra["agent"] for i in r.output]
    assert agents[0] == "root" and r.output[0].type == "reasoning"  # the plan
    plan = json.loads(r.output[0].content[0].text)["subtasks"]
    assert len(plan) == 3
    assert sorted(set(agents[1:-1])) == ["agent_1", "agent_2", "agent_3"]
    assert all(i.type == "reasoning" for i in r.output[1:-1])
    assert r.output[-1].type == "message" and agents[-1] == "root"
    assert r.output_text == "Summary: result of agent_1; result of agent_2; result of agent_3"
    assert team.most == 3  # all three agents' turns were open at once
    assert r.model_extra["accounting"]["mode"] == "ultra"
    per = r.model_extra["accounting"]["agents"]
    assert set(per) == {"root", "agent_1", "agent_2", "agent_3"}
    assert sum(a["input_tokens"] for a in per.values()) == r.usage.input_tokens
    assert sum(a["output_tokens"] for a in per.values()) == r.usage.output_tokens
    assert per["root"]["model_turns"] == 2  # plan and synthesis
    # The synthesis alone is drafted by prompt lookup: it is the turn whose answer copies its input.
    asked = [(agent_of(b), "response_format" in b) for b in script.bodies if b.get("prompt_lookup")]
    assert asked == [(None, False)] and len(script.bodies) == 5
    script.policy = None


def test_each_agent_is_timed_to_its_own_end(scripted):
    client, script = scripted
    script.policy = Team(2, holds={"agent_1": 0.05, "agent_2": 0.8})
    r = client.responses.create(model=MODEL, input="Two?", extra_body={"multi_agent": {
        "enabled": True, "max_concurrent_subagents": 2}})
    per = r.model_extra["accounting"]["agents"]
    # 0.75, not 0.8: asyncio may end a sleep a clock tick early, and the seconds are rounded to 0.1 ms
    assert per["agent_1"]["seconds"] < 0.5 < 0.75 <= per["agent_2"]["seconds"], per
    script.policy = None


@pytest.mark.parametrize("how", [
    {"model": MODEL + "-ultra"},
    {"model": MODEL, "reasoning": {"effort": "ultra"}},
])
def test_ultra_by_model_name_or_effort(scripted, how):
    client, script = scripted
    script.policy = Team(4)
    r = client.responses.create(input="Four cities?", **how)
    assert r.output_text.count("result of agent_") == 4
    script.policy = None


def test_streamed_events_in_order_tagged_with_their_agent(scripted):
    client, script = scripted
    script.policy = Team(2, hold=0.1)
    with client.responses.stream(model=MODEL, input="Two cities?",
                                 extra_body={"multi_agent": {"enabled": True, "max_concurrent_subagents": 2}}) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert {e.model_extra["agent"] for e in deltas} == {"root", "agent_1", "agent_2"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and text.startswith("Summary:")
    indices = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert indices == list(range(len(final.output)))
    script.policy = None


def test_a_failed_agent_is_reported_and_the_rest_synthesise(scripted):
    client, script = scripted
    script.policy = Team(3, fail="agent_2")
    r = client.responses.create(model=MODEL + "-ultra", input="Three?",
                                extra_body={"multi_agent": {"max_concurrent_subagents": 3}})
    assert r.status == "completed"
    failed = [i for i in r.output if i.model_extra["agent"] == "agent_2"]
    assert failed and "failed" in failed[-1].content[0].text
    assert r.output_text == "Summary: result of agent_1; result of agent_3"
    assert r.model_extra["accounting"]["agents"]["agent_2"]["status"] == "failed"
    script.policy = None


def test_an_agent_waiting_on_a_client_tool_pauses_the_tree(scripted):
    client, script = scripted
    script.policy = Team(2, tool_agent="agent_1")
    r = client.responses.create(model=MODEL + "-ultra", input="Two?", tools=[WEATHER],
                                extra_body={"multi_agent": {"max_concurrent_subagents": 2}})
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].model_extra["agent"] == "agent_1" and r.output_text == ""
    r = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "snow"}])
    assert r.output_text == "Summary: result of agent_1 with snow; result of agent_2"
    # agent_2 finished in the first response and did not run again
    assert set(r.model_extra["accounting"]["agents"]) == {"agent_1", "root"}
    script.policy = None


def test_ultra_by_model_name_on_chat_completions(scripted):
    """Any chat client reaches Ultra by the name alone: the synthesis is the message, the plan and the
    agents' work its reasoning, streamed or not."""
    client, script = scripted
    script.policy = Team(2)
    try:
        r = client.chat.completions.create(model=MODEL + "-ultra", max_tokens=50, extra_body={"multi_agent": {
            "max_concurrent_subagents": 2}}, messages=[{"role": "user", "content": "Weather in two cities?"}])
        assert r.model == MODEL + "-ultra" and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == "Summary: result of agent_1; result of agent_2"
        thought = r.choices[0].message.model_extra["reasoning_content"]
        assert "[agent_1] result of agent_1" in thought and "[agent_2] result of agent_2" in thought
        assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(client.chat.completions.create(
            model=MODEL + "-ultra", max_tokens=50, stream=True, stream_options={"include_usage": True},
            extra_body={"multi_agent": {"max_concurrent_subagents": 2}},
            messages=[{"role": "user", "content": "Weather in two cities?"}]))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content
        assert "[agent_2] result of agent_2" in "".join((d.model_extra or {}).get("reasoning_content") or ""
                                                       for d in deltas)
        assert chunks[-1].usage.completion_tokens > 0
    finally:
        script.policy = None
    # what only the Responses API's items can carry: a 400 that says where to go
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL + "-ultra", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert "/v1/responses" in e.value.body["message"] and e.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):  # the name of no model, -ultra or not
        client.chat.completions.create(model="no-such-model-ultra", messages=[{"role": "user", "content": "x"}])


def test_n_is_bounded(scripted):
    client, _ = scripted
    for n in (0, 17, "4"):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="x",
                                    extra_body={"multi_agent": {"enabled": True, "max_concurrent_subagents": n}})


@pytest.fixture(scope="module")
def real(smollm, tmp_path_factory):
    server = start_server(smollm, names=[MODEL], state_db=tmp_path_factory.mktemp("state") / "s.db")
    yield server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    server.stop()


def test_subagents_are_batched_in_one_engine(real):
    server, client = real
    before = server.engine.stats.max_batch_size
    server.engine.stats.max_batch_size = 0
    hits = server.engine.blocks.prefix_hit_tokens
    drafts = server.engine.stats.spec.drafts
    r = client.responses.create(model=MODEL + "-ultra", input="Write about four animals: cats, dogs, owls, bees.",
                                temperature=0, max_output_tokens=200,
                                extra_body={"multi_agent": {"max_concurrent_subagents": 4}})
    assert r.status in ("completed", "incomplete")
    per = r.model_extra["accounting"]["agents"]
    assert {"agent_1", "agent_2", "agent_3", "agent_4"} <= set(per)
    # the four agents' decode steps ran in the same engine steps
    assert server.engine.stats.max_batch_size >= 4, server.engine.stats
    # and their instructions, the same for all four, were computed once: three agents found them cached
    assert server.engine.blocks.prefix_hit_tokens - hits >= 3 * 3 * BLOCK
    # the synthesis, which alone asks for prompt lookup on a server that does not speculate, drafted
    assert server.engine.stats.spec.drafts > drafts
    server.engine.stats.max_batch_size = max(before, server.engine.stats.max_batch_size)


def test_cancelling_the_stream_stops_every_agent(real):
    server, client = real
    with client.responses.stream(model=MODEL + "-ultra", input="Write long stories about four animals.",
                                 temperature=0, extra_body={"multi_agent": {"max_concurrent_subagents": 4}}) as s:
        seen = set()
        for e in s:
            if e.type == "response.reasoning_text.delta":
                seen.add(e.model_extra["agent"])
            if len(seen - {"root"}) >= 2:
                break  # leaves the stream: the client goes away mid-response
    server.wait_idle(30)
    assert server.engine.blocks.num_used == 0 and server.engine.blocks.usage == 0.0


def test_delete_cancels_a_response_being_made(real):
    server, client = real
    result: dict = {}

    def make() -> None:
        try:
            result["r"] = client.responses.create(model=MODEL + "-ultra", input="Write long stories about owls.",
                                                  temperature=0)
        except Exception as e:  # noqa: BLE001
            result["e"] = e

    t = threading.Thread(target=make)
    t.start()
    deadline = time.monotonic() + 30
    while server.served.engine.num_running < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    service = server.server.config.app.state.agents[0]  # type: ignore[attr-defined]
    assert len(service.active) == 1, (service.active, server.served.engine.num_running, result)
    (rid,) = list(service.active)
    client.responses.delete(rid)
    t.join(60)
    assert not t.is_alive()
    server.wait_idle(30)
    assert result["r"].status == "cancelled", result  # what the waiting request gets: the response, stopped


def test_the_agents_sdk_reaches_ultra_and_max_by_model_name_and_effort(scripted):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    client, script = scripted
    sdk = AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0, timeout=60)
    agents.set_tracing_disabled(True)
    ultra = agents.Agent(name="u", model=agents.OpenAIResponsesModel(MODEL + "-ultra", sdk))
    deep = agents.Agent(name="m", model=agents.OpenAIResponsesModel(MODEL, sdk),
                        model_settings=agents.ModelSettings(reasoning=Reasoning(effort="high")))

    async def both():  # type: ignore[no-untyped-def]
        script.policy = Team(4)
        first = await agents.Runner.run(ultra, "Four cities?")
        script.policy = None
        script.turns[:] = [{"reasoning": "think", "text": "done"}]
        return first, await agents.Runner.run(deep, "Hard question?")

    first, second = asyncio.run(both())
    assert first.final_output.count("result of agent_") == 4
    assert second.final_output == "done" and script.bodies[-1]["reasoning_effort"] == "high"


def test_results_too_long_for_the_context_are_cut_for_the_synthesis(scripted):
    from wafer.errors import APIError

    client, script = scripted
    team = Team(2)
    tries = []

    async def policy(body):  # type: ignore[no-untyped-def]
        if agent_of(body) is None and not body.get("response_format"):
            tries.append(len(body["messages"][-1]["content"]))
            if len(tries) == 1:
                raise APIError(400, "too long", "invalid_request_error", "messages", "context_length_exceeded")
            return "merged"
        if agent_of(body):
            return "x" * 4000
        return await team(body)

    script.policy = policy
    r = client.responses.create(model=MODEL + "-ultra", input="Two?",
                                extra_body={"multi_agent": {"max_concurrent_subagents": 2}})
    script.policy = None
    assert r.output_text == "merged" and len(tries) == 2 and tries[1] < tries[0] - 3000
