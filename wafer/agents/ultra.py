"""Ultra: a root agent splits the task, N sub-agents work on the parts at once, the root merges
what they found.

The sub-agents are ordinary agent loops (the same turns, tools and programs as any response), run
concurrently against the same backend, so on a local model their decoding is batched by the engine
and the prompt they share is computed once by the prefix cache. Their items appear in the root
response tagged with the agent's name; their text as `reasoning` items, so that the response's
output text is the synthesis alone. A sub-agent that calls the client's tools makes the whole
response wait for the outputs; the next request (by `previous_response_id`) resumes the tree.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from wafer import tracing
from wafer.agents.items import new_id
from wafer.agents.plan import Events, Plan
from wafer.errors import APIError, bad_request

if TYPE_CHECKING:  # the service drives the turns; this module only orders them
    from wafer.agents.responses import ResponsesService

DEFAULT_SUBAGENTS = 4
MAX_SUBAGENTS = 16
SUBAGENT_TOKENS = 512  # each sub-agent's output budget over all its turns, unless the request says
SUBAGENT_SECONDS = 300.0
PART_CHARS = 200  # a sub-task's length in the plan's schema: what the plan's budget allows for
PLAN_TOKENS_PER_TASK = PART_CHARS // 2 + 20  # a part of one- or two-character tokens still fits

PLANNER = ("You lead a team of {n} agents who work at the same time. Split the user's task into exactly {n} "
           "independent sub-tasks, one per agent. Each sub-task is a complete instruction that one agent can "
           "carry out alone, without the others' results. Reply with the JSON object only.")
# The agents' instructions are the same for all of them, so that with the tools they make one prefix
# that the engine computes once for the team; what differs (the name, the part) is the user turn.
SUBAGENT = ("You are one of {n} agents working in parallel on parts of a larger task.\n"
            "The whole task, for context: {task}\n"
            "Do only your part, which the user gives you. Use the tools if they help. Then answer with what you "
            "found, briefly.")
PART = "You are {name}. Your part: {part}"
SYNTHESIS = ("Your team of agents worked on parts of the user's task. Their results follow. Combine them into one "
             "answer to the task. Do not mention the agents.")


def settings(req: Any, model: str, subagent_model: str | None = None) -> tuple[str, dict[str, Any] | None]:
    """The model to run and Ultra's settings, if the request asks for Ultra: by `multi_agent`, by
    `reasoning.effort: "ultra"`, or by a model name ending in `-ultra`. Sub-agents run on the
    request's `multi_agent.subagent_model`, else `subagent_model` (wafer.toml's), else the root's."""
    base = model.removesuffix("-ultra")
    asked = req.multi_agent or {}
    on = bool(asked.get("enabled")) or (req.reasoning is not None and req.reasoning.effort == "ultra") \
        or base != model
    if not on:
        return model, None
    n = asked.get("max_concurrent_subagents", DEFAULT_SUBAGENTS)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SUBAGENTS:
        raise bad_request(f"multi_agent.max_concurrent_subagents must be an integer from 1 to {MAX_SUBAGENTS}.",
                          "multi_agent.max_concurrent_subagents")
    sub = asked.get("subagent_model")
    if sub is not None and not isinstance(sub, str):
        raise bad_request("multi_agent.subagent_model must be a model name.", "multi_agent.subagent_model")
    budget = asked.get("max_output_tokens_per_agent", SUBAGENT_TOKENS)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad_request("multi_agent.max_output_tokens_per_agent must be a positive integer.",
                          "multi_agent.max_output_tokens_per_agent")
    return base, {"n": n, "subagent_model": sub or subagent_model or base, "agent_tokens": budget}


def _text(item: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in item.get("content") or [])


def _view(item: dict[str, Any], agent: str, as_reasoning: bool) -> dict[str, Any]:
    """An item as the root response shows it: tagged with its agent; a message as reasoning when it
    is an agent's working, not the answer."""
    if as_reasoning and item["type"] == "message":
        return {"id": item["id"], "type": "reasoning", "agent": agent, "summary": [],
                "content": [{"type": "reasoning_text", "text": _text(item)}], "status": item.get("status")}
    return {**item, "agent": agent}


class Relay:
    """Passes the events of the agents' own plans on as the root response's: one numbering, one
    output list, items tagged with their agent."""

    def __init__(self, root: Plan, ev: Events) -> None:
        self.root, self.ev = root, ev
        self.refs: list[tuple[dict[str, Any], str, bool]] = []  # live item, agent, shown as reasoning
        self.where: dict[tuple[int, int], int] = {}  # (id of the agent's plan, its index) -> root index

    def __call__(self, plan: Plan, event: dict[str, Any], as_reasoning: bool) -> dict[str, Any] | None:
        kind = event["type"]
        fields = {k: v for k, v in event.items() if k not in ("type", "sequence_number")}
        if "output_index" in fields:
            key = (id(plan), fields["output_index"])
            if kind == "response.output_item.added":
                self.where[key] = len(self.refs)
                self.refs.append((plan.output[fields["output_index"]], plan.agent, as_reasoning))
            fields["output_index"] = self.where[key]
        if "item" in fields:
            fields["item"] = _view(fields["item"], plan.agent, as_reasoning)
        fields["agent"] = plan.agent
        message = as_reasoning and kind.startswith(("response.output_text", "response.content_part"))
        if message:
            if kind.startswith("response.content_part"):
                return None
            kind = kind.replace("output_text", "reasoning_text")
            fields.pop("logprobs", None)
        return self.ev(kind, **fields)

    def materialize(self) -> list[dict[str, Any]]:
        return [_view(item, agent, r) for item, agent, r in self.refs]


class Ultra:
    def __init__(self, service: ResponsesService) -> None:
        self.service = service

    def _derived(self, root: Plan, agent: str, instructions: str, history: list[dict[str, Any]],
                 new_items: list[dict[str, Any]], tools: bool, max_tokens: int | None,
                 response_format: dict[str, Any] | None = None, model: str | None = None) -> Plan:
        # No effort passes on: "ultra" asked for this tree, and each agent's turns are plain ones.
        req = root.req.model_copy(update={"instructions": instructions, "max_output_tokens": max_tokens,
                                          "model": model or root.req.model, "previous_response_id": None,
                                          "reasoning": None})
        return Plan(req, root.rid, root.created_at, history, new_items, root.chat_tools if tools else [],
                    root.programmatic if tools else [], root.ptc and tools, "auto" if tools else "none",
                    response_format, agent=agent, tenant=root.tenant)

    def _absorb(self, root: Plan, part: Plan) -> dict[str, Any]:
        for key in root.usage:
            root.usage[key] += part.usage[key]
        a = part.accounting
        root.accounting["turns"] += [{**t, "agent": part.agent} for t in a["turns"]]
        for caller, n in a["tool_calls"].items():
            root.accounting["tool_calls"][caller] += n
        root.accounting["programs"] += a["programs"]
        return {"input_tokens": part.usage["input"], "output_tokens": part.usage["output"],
                "model_turns": len(a["turns"])}

    @staticmethod
    def _task(items: list[dict[str, Any]]) -> str:
        return "\n".join(_text(i) for i in items if i["type"] == "message" and i["role"] == "user")

    async def run(self, root: Plan, ev: Events) -> AsyncIterator[dict[str, Any]]:
        relay = Relay(root, ev)
        cfg = root.ultra or {}
        state = root.ultra_state
        usage_by_agent: dict[str, dict[str, Any]] = {}
        try:
            if state is None:
                n = cfg["n"]
                schema = {"type": "object", "additionalProperties": False, "required": ["subtasks"], "properties": {
                    "subtasks": {"type": "array", "minItems": n, "maxItems": n,
                                 "items": {"type": "string", "minLength": 1, "maxLength": PART_CHARS}}}}
                planner = self._derived(root, "root", PLANNER.format(n=n), root.history, root.new_items, False,
                                        PLAN_TOKENS_PER_TASK * n + 40,
                                        {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema,
                                                                                "strict": True}})
                async for event in self.service._model_turn(planner, Events(), []):
                    if event["type"] == "incomplete":
                        continue  # the grammar closes the JSON as the budget runs out; it is read below
                    out = relay(planner, event, True)
                    if out is not None:
                        yield out
                usage_by_agent["root"] = self._absorb(root, planner)
                try:
                    parts = json.loads(_text(planner.output[-1]))["subtasks"]
                except (ValueError, KeyError, IndexError, TypeError):  # cut short all the same: each takes an angle
                    parts = [f"Work on the task from angle {k + 1} of {n}, different from the other agents'."
                             for k in range(n)]
                task = self._task(root.history + root.new_items)
                state = {"n": n, "subagent_model": cfg["subagent_model"], "agent_tokens": cfg["agent_tokens"],
                         "task": task, "agents": {
                    f"agent_{k + 1}": {"part": part, "items": [], "status": "pending"}
                    for k, part in enumerate(parts[:n])}}
            root.accounting["ultra"] = state
            async for event in self._subagents(root, state, relay, usage_by_agent):
                yield event
            if not any(a["status"] == "waiting" for a in state["agents"].values()):
                async for event in self._synthesis(root, state, relay, usage_by_agent):
                    yield event
        finally:
            root.output[:] = relay.materialize()
            root.accounting["agents"] = usage_by_agent

    async def _subagents(self, root: Plan, state: dict[str, Any], relay: Relay,
                         usage_by_agent: dict[str, dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        outputs = {i["call_id"]: i for i in root.new_items if i["type"] == "function_call_output"}
        queue: asyncio.Queue[tuple[Plan, dict[str, Any] | None]] = asyncio.Queue()
        plans: dict[str, Plan] = {}
        n = len(state["agents"])
        for name, agent in state["agents"].items():
            if agent["status"] not in ("pending", "waiting"):
                continue
            new: list[dict[str, Any]] = []
            if agent["status"] == "pending":
                new = [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                        "content": [{"type": "input_text", "text": PART.format(name=name, part=agent["part"])}]}]
            else:
                owed = _owed(agent["items"])
                missing = [c for c in owed if c not in outputs]
                if missing:
                    raise bad_request(f"{name} waits on the outputs of calls {', '.join(missing)}; send them all "
                                      "together.", "input")
                new = [outputs[c] for c in owed]
            plan = self._derived(root, name, SUBAGENT.format(n=n, task=state["task"]),
                                 agent["items"], new, True, state["agent_tokens"], model=state["subagent_model"])
            outs = {i["call_id"] for i in new if i["type"] == "function_call_output"}
            plan.resume = self.service.pool.claim(outs, root.tenant) if outs else None
            plans[name] = plan

        finished: dict[str, float] = {}

        async def work(plan: Plan) -> None:
            # Each agent's task has a context of its own: its span is the parent of its turns alone.
            parent = tracing.current()
            span = None if parent is None else parent.child(f"invoke_agent {plan.agent}", {
                tracing.OPERATION: "invoke_agent", tracing.AGENT_NAME: plan.agent, tracing.REQUEST_MODEL: plan.req.model})
            tracing.CURRENT.set(span or parent)
            try:
                async with asyncio.timeout(SUBAGENT_SECONDS):
                    async for event in self.service._turns(plan, Events()):
                        await queue.put((plan, event))
            except Exception as e:  # noqa: BLE001 - one agent's failure is reported; the others go on
                plan.failure = e if isinstance(e, APIError) else APIError(
                    500, "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}")
                if span is not None:
                    span.fail(plan.failure.message)
            finally:
                if span is not None:
                    span.set({tracing.INPUT_TOKENS: plan.usage["input"], tracing.OUTPUT_TOKENS: plan.usage["output"]})
                    span.end()
                for program in plan.running:
                    await program.kill()
                finished[plan.agent] = time.monotonic()
                await queue.put((plan, None))

        tasks = [asyncio.ensure_future(work(p)) for p in plans.values()]
        started = time.monotonic()
        try:
            left = len(tasks)
            while left:
                plan, event = await queue.get()
                if event is None:
                    left -= 1
                    continue
                if event["type"] == "incomplete":
                    continue
                out = relay(plan, event, True)
                if out is not None:
                    yield out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for name, plan in plans.items():
            agent = state["agents"][name]
            agent["items"] = plan.history + plan.new_items + plan.output
            messages = [i for i in plan.output if i["type"] == "message"]
            if plan.failure is not None:
                agent["status"], agent["result"] = "failed", f"failed: {plan.failure.message}"
                note = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "incomplete",
                        "content": [{"type": "output_text", "text": agent["result"], "annotations": []}]}
                plan.output.append(note)
                for kind in ("response.output_item.added", "response.output_item.done"):
                    out = relay(plan, {"type": kind, "output_index": len(plan.output) - 1, "item": note}, True)
                    if out is not None:
                        yield out
            elif _owed(agent["items"]):
                agent["status"] = "waiting"
            else:
                agent["status"], agent["result"] = "done", _text(messages[-1]) if messages else ""
            usage_by_agent[name] = {**self._absorb(root, plan), "status": agent["status"],
                                    "seconds": round(finished.get(name, time.monotonic()) - started, 4)}

    async def _synthesis(self, root: Plan, state: dict[str, Any], relay: Relay,
                         usage_by_agent: dict[str, dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        said = [i for i in root.history + root.new_items if i["type"] == "message"]
        longest = max((len(a.get("result", "")) for a in state["agents"].values()), default=0)
        for attempt in range(4):
            # Each result cut to a share of what the model's context takes, when all of them do not fit.
            cut = longest if attempt == 0 else longest >> attempt
            results = "\n\n".join(f"{name} ({a['part']}):\n{a.get('result', '')[:cut]}"
                                   for name, a in state["agents"].items())
            note = {"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                    "content": [{"type": "input_text", "text": "Results of the agents:\n\n" + results}]}
            synth = self._derived(root, "root", SYNTHESIS, [], said + [note], False,
                                  root.req.max_output_tokens, root.response_format)
            synth.copies_input = True
            started = False
            try:
                async for event in self.service._model_turn(synth, Events(), []):
                    started = True
                    if event["type"] == "incomplete":
                        yield event
                        continue
                    out = relay(synth, event, False)
                    if out is not None:
                        yield out
            except APIError as e:
                if started or e.code != "context_length_exceeded" or attempt == 3:
                    raise
                continue
            break
        spent = self._absorb(root, synth)
        before = usage_by_agent.get("root") or {k: 0 for k in spent}
        usage_by_agent["root"] = {k: before[k] + spent[k] for k in spent}


def _owed(items: list[dict[str, Any]]) -> list[str]:
    """Call ids of the agent's function calls that have no output yet."""
    answered = {i["call_id"] for i in items if i["type"] == "function_call_output"}
    return [i["call_id"] for i in items if i["type"] == "function_call" and i["call_id"] not in answered]


def resumable(accounting: dict[str, Any]) -> dict[str, Any] | None:
    """The sub-agents' state of an Ultra response that waits on the client's tool outputs."""
    state = accounting.get("ultra")
    if state and any(a["status"] == "waiting" for a in state["agents"].values()):
        return copy.deepcopy(state)
    return None
