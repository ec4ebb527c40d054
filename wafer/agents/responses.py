"""The Responses API over a chat backend: a response is one or more model turns, with the
programs they write run in the sandbox between turns, streamed as the API's typed events.

A response ends when the model answers in text, calls the client's tools, or a program waits on
the client's tools (it stays parked and resumes when a later request brings the outputs).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from wafer.agents.backend import ChatBackend
from wafer.agents.items import PROGRAM_TOOL, ResponseRequest, chat_messages, input_items, new_id
from wafer.agents.program import Program, ProgramResult, ToolSpec
from wafer.agents.plan import Events, Plan
from wafer.agents.ptc import Parked, ProgramPool, program_code, program_tool
from wafer.agents.sandbox import Limits, SandboxUnavailable, check_sandbox
from wafer.agents.store import ResponseStore
from wafer.agents.ultra import Ultra, resumable, settings
from wafer import tracing
from wafer.errors import APIError, bad_request, server_error

log = logging.getLogger("wafer.agents")

MAX_TURNS = 16  # model turns in one response (each program that ends gives the model another)


def _not_found(rid: str) -> APIError:
    return APIError(404, f"No response found with id '{rid}'.", "invalid_request_error", "response_id",
                    "response_not_found")


class ResponsesService:
    def __init__(self, backend: ChatBackend, store: ResponseStore, pool: ProgramPool | None = None,
                 limits: Limits | None = None, prices: dict[str, dict[str, float]] | None = None,
                 subagent_model: str | None = None) -> None:
        self.subagent_model = subagent_model  # Ultra's sub-agents' model when the request names none
        # USD per million tokens, by the model name a turn's chunks carry: {"input": x, "output": y}
        self.prices = prices or {}
        # Called with every finished response (the server counts them in its metrics).
        self.on_finish: list[Callable[[dict[str, Any]], None]] = []
        self.active: dict[str, Plan] = {}  # responses being made, by id, with their tenant: what DELETE cancels
        self.backend = backend
        self.store = store
        self.pool = pool or ProgramPool()
        self.limits = limits or Limits()

    # --- reading back ------------------------------------------------------------------------
    # `tenant`: whose key asks (None on a server without keys); another tenant's response is not found.
    async def get(self, rid: str, tenant: str | None = None) -> dict[str, Any]:
        found = await asyncio.to_thread(self.store.get, rid, tenant)
        if found is None:
            raise _not_found(rid)
        return found[0]

    async def delete(self, rid: str, tenant: str | None = None) -> dict[str, Any]:
        running = self.active.get(rid)
        if running is not None and running.tenant == tenant:
            # still being made: it stops, every agent and program of it, and is not stored
            del self.active[rid]
            running.cancel()
        else:
            running = None
        if not await asyncio.to_thread(self.store.delete, rid, tenant) and running is None:
            raise _not_found(rid)
        self.pool.drop_response(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    async def input_items(self, rid: str, after: str | None, limit: int, order: str,
                          tenant: str | None = None) -> dict[str, Any]:
        found = await asyncio.to_thread(self.store.get, rid, tenant)
        if found is None:
            raise _not_found(rid)
        items = found[1] if order == "asc" else found[1][::-1]
        if after is not None:
            ids = [i.get("id") for i in items]
            if after not in ids:
                raise bad_request(f"No input item with id '{after}' in response '{rid}'.", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit}

    async def close(self) -> None:
        await self.pool.close()

    # --- creating ----------------------------------------------------------------------------
    async def plan(self, req: ResponseRequest, tenant: str | None = None) -> Plan:
        """Every check that can fail before generation starts, so that it fails as an HTTP error.
        `tenant`: whose key asks; it continues and references only its own responses."""
        history: list[dict[str, Any]] = []
        task_before: dict[str, Any]
        if req.previous_response_id is not None:
            chain = await asyncio.to_thread(self.store.chain, req.previous_response_id, tenant)
            if not chain:
                raise bad_request(f"Previous response with id '{req.previous_response_id}' not found.",
                                  "previous_response_id", "previous_response_not_found")
            for response, inputs, _ in chain:
                # An Ultra response's sub-agents worked for it: the conversation goes on from its root's items.
                history += inputs + [i for i in response["output"] if i.get("agent", "root") == "root"]
            task_before = chain[-1][2].get("task") or {}
            ultra_state = resumable(chain[-1][2])
        else:
            task_before, ultra_state = {}, None
        model, ultra = settings(req, req.model, self.subagent_model)
        if ultra_state is not None:
            ultra = {k: ultra_state[k] for k in ("n", "subagent_model", "agent_tokens")}
        req = req.model_copy(update={"model": model})
        new = await asyncio.to_thread(input_items, req.input)  # grows with the input: off the loop
        self._check_models(model, ultra)
        known = {i.get("id"): i for i in history + new if i.get("type") != "item_reference"}
        for i, item in enumerate(new):
            if item["type"] == "item_reference":
                if item["id"] not in known:
                    raise bad_request(f"Item with id '{item['id']}' not found.", f"input[{i}].id")
                new[i] = known[item["id"]]
        if not history and not new:
            raise bad_request("Missing required parameter: 'input'.", "input", "missing_required_parameter")
        chat_tools, programmatic, ptc = self._tools(req)
        outputs = {i["call_id"] for i in new if i["type"] == "function_call_output"}
        plan = Plan(req, new_id("resp"), int(time.time()), history, new, chat_tools, programmatic, ptc,
                    self._tool_choice(req, chat_tools), self._format(req))
        plan.task_before = task_before
        plan.tenant = tenant
        plan.ultra, plan.ultra_state = ultra, ultra_state
        if ultra_state is not None:
            return plan  # the sub-agents claim their own parked programs
        plan.resume = self.pool.claim(outputs, tenant) if outputs else None
        if plan.resume is not None:
            missing = plan.resume.pending.keys() - outputs
            if missing:
                self.pool.park(plan.resume)  # not this request's to consume: back it goes
                raise bad_request(f"The program {plan.resume.call_id} waits on the outputs of calls "
                                  f"{', '.join(sorted(missing))}; send them all together.", "input")
        return plan

    def _check_models(self, model: str, ultra: dict[str, Any] | None) -> None:
        """The models the response's turns will ask for, known before the first turn: an unknown
        sub-agent model would otherwise fail only after the plan's turn, many seconds in."""
        check = getattr(self.backend, "check_model", None)
        if check is None:
            return
        check(model)
        if ultra is not None and ultra["subagent_model"] != model:
            try:
                check(ultra["subagent_model"])
            except APIError as e:
                raise bad_request(f"Invalid value for 'multi_agent.subagent_model': {e.message}",
                                  "multi_agent.subagent_model", "model_not_found") from None

    def _tools(self, req: ResponseRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        chat: list[dict[str, Any]] = []
        programmatic: list[dict[str, Any]] = []
        ptc = False
        names: set[str] = set()
        for i, tool in enumerate(req.tools or []):
            kind = tool.get("type")
            if kind == "programmatic_tool_calling":
                ptc = True
                continue
            if kind != "function":
                raise bad_request(f"Tools of type {kind!r} are not supported by this server (function and "
                                  "programmatic_tool_calling are).", f"tools[{i}].type", "unsupported_tool")
            name = tool.get("name")
            if not isinstance(name, str) or not name or name == PROGRAM_TOOL or name in names:
                raise bad_request(f"Invalid value for 'tools[{i}].name': tool names must be unique strings other "
                                  f"than {PROGRAM_TOOL!r}.", f"tools[{i}].name")
            names.add(name)
            callers = tool.get("allowed_callers") or ["direct"]
            if not isinstance(callers, list) or not set(callers) <= {"direct", "programmatic"}:
                raise bad_request("allowed_callers lists 'direct' and/or 'programmatic'.",
                                  f"tools[{i}].allowed_callers")
            fn = {"name": name, "description": tool.get("description"), "parameters": tool.get("parameters") or
                  {"type": "object", "properties": {}}}
            if "direct" in callers:
                chat.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
            if "programmatic" in callers:
                programmatic.append(fn)
        if ptc:
            reason = check_sandbox()
            if reason is not None:
                raise APIError(400, f"Programmatic tool calling is not available on this server: {reason}",
                               "invalid_request_error", "tools", "sandbox_unavailable")
            if not programmatic:
                raise bad_request("programmatic_tool_calling needs at least one function tool with "
                                  "allowed_callers including 'programmatic'.", "tools")
            chat.append(program_tool(programmatic))
        return chat, programmatic, ptc

    def _tool_choice(self, req: ResponseRequest, chat_tools: list[dict[str, Any]]) -> str | dict[str, Any]:
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if isinstance(choice, dict):
            kind = choice.get("type")
            name = PROGRAM_TOOL if kind == "programmatic_tool_calling" else choice.get("name")
            if kind not in ("function", "programmatic_tool_calling") or \
                    name not in [t["function"]["name"] for t in chat_tools]:
                raise bad_request("tool_choice names a tool that is not in tools.", "tool_choice")
            return {"type": "function", "function": {"name": name}}
        if choice == "required" and not chat_tools:
            raise bad_request("tool_choice 'required' needs tools.", "tool_choice")
        return choice

    def _format(self, req: ResponseRequest) -> dict[str, Any] | None:
        fmt = req.text.format if req.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise bad_request("Missing required parameter: 'text.format.schema'.", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                       "strict": fmt.strict}}

    def response(self, plan: Plan, status: str, error: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        req = plan.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        u = plan.usage
        return {
            "id": plan.rid, "object": "response", "created_at": plan.created_at, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": plan.output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_p": req.top_p, "truncation": req.truncation or "disabled",
            "usage": {"input_tokens": u["input"], "input_tokens_details": {"cached_tokens": u["cached"]},
                      "output_tokens": u["output"], "output_tokens_details": {"reasoning_tokens": u["reasoning"]},
                      "total_tokens": u["input"] + u["output"]} if status != "in_progress" else None,
            "user": req.user, "metadata": req.metadata or {},
            # wafer's own: the model turns, tool calls and program runs behind this response
            "accounting": plan.accounting,
        }

    async def run(self, plan: Plan) -> AsyncIterator[dict[str, Any]]:
        """The response's events, from `response.created` to `response.completed` (or `.incomplete`,
        or an `error` and `response.failed`); stored at the end when the request asks for it."""
        ev = Events()
        yield ev("response.created", response=self.response(plan, "in_progress"))
        yield ev("response.in_progress", response=self.response(plan, "in_progress"))
        status, error, incomplete = "completed", None, None
        self.active[plan.rid] = plan
        body = Ultra(self).run(plan, ev) if plan.ultra is not None else self._turns(plan, ev)
        # The steps share one context, as one task running the body would: what a step sets (the
        # span that a turn opens, under which its programs run) holds in the steps after it.
        steps = contextvars.copy_context()
        try:
            while not plan.cancelled:
                # Each step a task of its own, which DELETE cancels: the body stops where it is (its
                # turns, agents and programs with it) and this stream goes on to its terminal event.
                plan.step = asyncio.get_running_loop().create_task(_next(body), context=steps)
                try:
                    event = await plan.step
                except asyncio.CancelledError:
                    if not plan.cancelled or asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise  # not DELETE's: the request itself is cancelled (its client went)
                    break
                if event is None:
                    break
                if event["type"] == "incomplete":
                    status, incomplete = "incomplete", event["reason"]
                    continue
                yield event
            if plan.cancelled:
                # OpenAI's status for a response stopped before its end; its streams have no event of
                # that name, so the stream ends as a failure does: an error event, then response.failed.
                status, error, incomplete = "cancelled", None, None
                yield ev("error", code="response_cancelled", param=None,
                         message=f"The response {plan.rid} was deleted while in progress.")
        except Exception as e:  # noqa: BLE001 - a failure of this response, not of the server
            if isinstance(e, APIError):
                failure = e
            else:
                log.exception("response %s failed", plan.rid)
                failure = server_error("Internal error.", plan.rid)  # the log names it by the response's id
            plan.failure = failure
            status, error = "failed", {"code": failure.code or "server_error", "message": failure.message}
            yield ev("error", code=failure.code, message=failure.message, param=failure.param)
        finally:
            self.active.pop(plan.rid, None)
            await body.aclose()  # a body left mid-way closes its turns' streams (their sequences end)
            for program in plan.running:  # started here and not parked: a response cut short frees them
                await program.kill()
        self._totals(plan)
        final = self.response(plan, status, error, incomplete)
        if (span := tracing.current()) is not None:
            span.set({tracing.INPUT_TOKENS: plan.usage["input"], tracing.OUTPUT_TOKENS: plan.usage["output"],
                      tracing.RESPONSE_MODEL: plan.req.model, tracing.FINISH_REASONS: [incomplete or status]})
            if error is not None:
                span.fail(error["message"])
        for hook in self.on_finish:
            hook(final)
        if plan.req.store and not plan.cancelled:  # a deleted response stays deleted
            await asyncio.to_thread(self.store.put, final, plan.new_items, plan.accounting, plan.tenant)
        yield ev({"completed": "response.completed", "failed": "response.failed", "cancelled": "response.failed",
                  "incomplete": "response.incomplete"}[status], response=final)

    def _totals(self, plan: Plan) -> None:
        """This response's totals, and the task's: every response of its chain up to this one."""
        a = plan.accounting
        own = {"responses": 1, "model_turns": len(a["turns"]),
               "input_tokens": sum(t["input_tokens"] for t in a["turns"]),
               "output_tokens": sum(t["output_tokens"] for t in a["turns"]),
               "reasoning_tokens": sum(t.get("reasoning_tokens", 0) for t in a["turns"]),
               "tool_calls": sum(a["tool_calls"].values()), "program_runs": len(a["programs"]),
               "seconds": round(time.monotonic() - plan.started, 4),
               "cost_usd": round(sum(t["cost_usd"] for t in a["turns"]), 8)}
        a["seconds"], a["cost_usd"] = own["seconds"], own["cost_usd"]
        a["mode"] = mode_of(plan)
        a["task"] = {k: round(v + plan.task_before.get(k, 0), 8) for k, v in own.items()}

    async def _turns(self, plan: Plan, ev: Events) -> AsyncIterator[dict[str, Any]]:
        if plan.resume is not None:
            parked = plan.resume
            outputs = {i["call_id"]: i["output"] for i in plan.new_items if i["type"] == "function_call_output"}
            plan.running.append(parked.program)
            await parked.program.resume({k: outputs[k] for k in parked.pending})
            async for event in self._advance(plan, ev, parked.program, parked.call_id, parked.started,
                                             parked.run_seconds):
                yield event
            if _waiting(plan):
                return
        else:
            async for event in self._orphaned_programs(plan, ev):
                yield event
        for _ in range(MAX_TURNS):
            if plan.req.max_output_tokens is not None and plan.usage["output"] >= plan.req.max_output_tokens:
                yield {"type": "incomplete", "reason": "max_output_tokens"}  # spent by the turns before
                return
            calls: list[dict[str, Any]] = []
            async for event in self._model_turn(plan, ev, calls):
                yield event
            direct = [c for c in calls if not (plan.ptc and c["name"] == PROGRAM_TOOL)]
            if direct or not calls or _waiting(plan):
                return  # an answer, the client's tools to run, or a program waiting on them
        yield {"type": "incomplete", "reason": "max_turns"}

    async def _orphaned_programs(self, plan: Plan, ev: Events) -> AsyncIterator[dict[str, Any]]:
        """Outputs for a program's calls with no program waiting (it timed out, or the server restarted):
        the program ends incomplete, so the model hears of it instead of the turn failing."""
        everything = plan.history + plan.new_items
        owed = {i["call_id"]: i for i in everything if i["type"] == "function_call"
                and (i.get("caller") or {}).get("type") == "program"}
        done = {i["call_id"] for i in everything if i["type"] == "program_output"}
        for item in plan.new_items:
            call = owed.get(item["call_id"]) if item["type"] == "function_call_output" else None
            if call is None or call["caller"]["caller_id"] in done:
                continue
            done.add(call["caller"]["caller_id"])
            out = {"id": new_id("progout"), "type": "program_output", "call_id": call["caller"]["caller_id"],
                   "result": "", "status": "incomplete", "error": "The program is no longer running (it waited "
                   f"longer than {self.pool.park_seconds:g} s for tool outputs, or the server restarted)."}
            plan.output.append(out)
            yield ev("response.output_item.added", output_index=len(plan.output) - 1, item=out)
            yield ev("response.output_item.done", output_index=len(plan.output) - 1, item=out)

    def _chat_body(self, plan: Plan) -> dict[str, Any]:
        req = plan.req
        body: dict[str, Any] = {"model": req.model, "messages": chat_messages(
            req.instructions, plan.history + plan.new_items + plan.output)}
        if plan.chat_tools and plan.tool_choice != "none":
            body.update(tools=plan.chat_tools, tool_choice=plan.tool_choice,
                        parallel_tool_calls=req.parallel_tool_calls)
        if plan.response_format is not None:
            body["response_format"] = plan.response_format
        if req.max_output_tokens is not None:
            body["max_completion_tokens"] = req.max_output_tokens - plan.usage["output"]
        for key in ("temperature", "top_p", "user", "seed"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
        if req.reasoning is not None and req.reasoning.effort is not None:
            body["reasoning_effort"] = req.reasoning.effort
        if plan.copies_input:
            body["prompt_lookup"] = True
        return body

    async def _model_turn(self, plan: Plan, ev: Events, calls: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """One chat completion, streamed as a message item and function call (or program) items; traced
        as a span of its own, the parent of its engine work, tool calls and programs."""
        parent = tracing.current()
        if parent is None:
            async for event in self._untraced_turn(plan, ev, calls):
                yield event
            return
        turn = parent.child(f"chat {plan.req.model}", {tracing.OPERATION: "chat", tracing.AGENT_NAME: plan.agent})
        try:
            with tracing.within(turn):
                async for event in self._untraced_turn(plan, ev, calls):
                    yield event
        except Exception as e:
            turn.fail(f"{type(e).__name__}: {e}")
            raise
        finally:
            turn.end()

    async def _untraced_turn(self, plan: Plan, ev: Events, calls: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        started = time.monotonic()
        message: dict[str, Any] | None = None
        reasoning: dict[str, Any] | None = None
        pending: dict[int, dict[str, Any]] = {}
        finish = None
        usage: dict[str, Any] = {}
        model = plan.req.model
        async for chunk in self.backend.stream(self._chat_body(plan)):
            usage = chunk.get("usage") or usage
            model = chunk.get("model") or model
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                thought = delta.get("reasoning_content") or delta.get("reasoning")  # vLLM's field, and its newer name
                if thought and message is None:
                    if reasoning is None:
                        reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                                     "content": [{"type": "reasoning_text", "text": ""}]}
                        plan.output.append(reasoning)
                        yield ev("response.output_item.added", output_index=len(plan.output) - 1,
                                 item=dict(reasoning, content=[]))
                    reasoning["content"][0]["text"] += thought
                    yield ev("response.reasoning_text.delta", item_id=reasoning["id"],
                             output_index=plan.output.index(reasoning), content_index=0, delta=thought)
                text = delta.get("content")
                if text and reasoning is not None and reasoning["status"] == "in_progress":
                    async for event in self._close_reasoning(plan, ev, reasoning):
                        yield event
                if text:
                    if message is None:
                        message = {"id": new_id("msg"), "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": []}
                        plan.output.append(message)
                        yield ev("response.output_item.added", output_index=len(plan.output) - 1, item=dict(
                            message, content=[]))
                        message["content"].append({"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []})
                        yield ev("response.content_part.added", item_id=message["id"],
                                 output_index=len(plan.output) - 1, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    message["content"][0]["text"] += text
                    yield ev("response.output_text.delta", item_id=message["id"],
                             output_index=plan.output.index(message), content_index=0, delta=text, logprobs=[])
                for tc in delta.get("tool_calls") or []:
                    call = pending.setdefault(tc.get("index", len(pending)), {"call_id": "", "name": "",
                                                                               "arguments": ""})
                    call["call_id"] = tc.get("id") or call["call_id"]
                    fn = tc.get("function") or {}
                    call["name"] += fn.get("name") or ""
                    call["arguments"] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
        if reasoning is not None and reasoning["status"] == "in_progress":
            async for event in self._close_reasoning(plan, ev, reasoning):
                yield event
        if message is not None:
            async for event in self._close_message(plan, ev, message):
                yield event
        u = {"input": usage.get("prompt_tokens", 0), "output": usage.get("completion_tokens", 0),
             "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
             "reasoning": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0}
        for key, value in u.items():
            plan.usage[key] += value
        price = self.prices.get(model) or {}
        cost = (u["input"] * price.get("input", 0.0) + u["output"] * price.get("output", 0.0)) / 1e6
        plan.accounting["turns"].append({"model": model, "input_tokens": u["input"], "cached_tokens": u["cached"],
                                         "output_tokens": u["output"], "reasoning_tokens": u["reasoning"],
                                         "cost_usd": round(cost, 8),
                                         "seconds": round(time.monotonic() - started, 4)})
        for index in sorted(pending):
            call = pending[index]
            call["call_id"] = call["call_id"] or new_id("call")
            calls.append(call)
            if call["name"] == PROGRAM_TOOL and plan.ptc:
                if any(c["name"] == PROGRAM_TOOL for c in calls[:-1]):
                    log.info("a second program in one turn was dropped: %r", call["arguments"][:200])
                    calls.pop()
                    continue
                async for event in self._program(plan, ev, call):
                    yield event
                continue
            plan.accounting["tool_calls"]["direct"] += 1
            async for event in self._function_call(plan, ev, call, None):
                yield event
        if finish == "length":
            yield {"type": "incomplete", "reason": "max_output_tokens"}
        elif finish == "interrupted":  # a backend's own reason: the server's shutdown cut the turn
            yield {"type": "incomplete", "reason": "interrupted"}

    async def _close_reasoning(self, plan: Plan, ev: Events, item: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        index = plan.output.index(item)
        item["status"] = "completed"
        yield ev("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                 text=item["content"][0]["text"])
        yield ev("response.output_item.done", output_index=index, item=item)

    async def _close_message(self, plan: Plan, ev: Events, message: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        index = plan.output.index(message)
        part = message["content"][0]
        message["status"] = "completed"
        yield ev("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                 text=part["text"], logprobs=[])
        yield ev("response.content_part.done", item_id=message["id"], output_index=index, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=index, item=message)

    async def _function_call(self, plan: Plan, ev: Events, call: dict[str, Any],
                             caller: dict[str, Any] | None) -> AsyncIterator[dict[str, Any]]:
        item: dict[str, Any] = {"id": new_id("fc"), "type": "function_call", "call_id": call["call_id"],
                                "name": call["name"], "arguments": "", "status": "in_progress"}
        if (span := tracing.current()) is not None:  # the client runs it: the span marks the call handed over
            now = time.monotonic()
            span.done(f"execute_tool {call['name']}", now, now, {
                tracing.OPERATION: "execute_tool", tracing.TOOL_NAME: call["name"], tracing.TOOL_CALL_ID: call["call_id"],
                tracing.TOOL_TYPE: "function", "wafer.tool.caller": "program" if caller else "direct"})
        if caller is not None:
            item["caller"] = caller
        plan.output.append(item)
        index = len(plan.output) - 1
        yield ev("response.output_item.added", output_index=index, item=dict(item))
        item["arguments"] = call["arguments"]
        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                 delta=call["arguments"])
        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 name=call["name"], arguments=call["arguments"])
        item["status"] = "completed"
        yield ev("response.output_item.done", output_index=index, item=item)

    async def _program(self, plan: Plan, ev: Events, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        code = program_code(call["arguments"]) or ""
        item = {"id": new_id("prog"), "type": "program", "call_id": call["call_id"], "code": code,
                "fingerprint": hashlib.sha256(code.encode()).hexdigest()[:32]}
        plan.output.append(item)
        index = len(plan.output) - 1
        yield ev("response.output_item.added", output_index=index, item=item)
        yield ev("response.output_item.done", output_index=index, item=item)
        started = time.monotonic()
        try:
            program = await Program.start(code, [ToolSpec(t["name"], t["parameters"]) for t in plan.programmatic],
                                          self.limits, self.pool)
        except SandboxUnavailable as e:  # checked at plan time; the sandbox broke since
            raise APIError(503, f"The program sandbox is not available: {e}", "server_error", None,
                           "sandbox_unavailable") from None
        plan.running.append(program)
        async for event in self._advance(plan, ev, program, call["call_id"], started, 0.0):
            yield event

    async def _advance(self, plan: Plan, ev: Events, program: Program, call_id: str, started: float,
                       ran: float) -> AsyncIterator[dict[str, Any]]:
        """Run the program to its end or to its next tool calls; traced as a span of its own."""
        parent = tracing.current()
        if parent is None:
            async for event in self._advance_untraced(plan, ev, program, call_id, started, ran):
                yield event
            return
        span = parent.child(f"execute_tool {PROGRAM_TOOL}", {tracing.OPERATION: "execute_tool",
                                                              tracing.TOOL_NAME: PROGRAM_TOOL,
                                                              tracing.TOOL_CALL_ID: call_id,
                                                              tracing.TOOL_TYPE: "extension"})
        try:
            with tracing.within(span):
                async for event in self._advance_untraced(plan, ev, program, call_id, started, ran):
                    yield event
        except Exception as e:
            span.fail(f"{type(e).__name__}: {e}")
            raise
        finally:
            span.end()

    async def _advance_untraced(self, plan: Plan, ev: Events, program: Program, call_id: str, started: float,
                                ran: float) -> AsyncIterator[dict[str, Any]]:
        t0 = time.monotonic()
        try:
            result = await program.advance()
        except BaseException:
            await program.kill()
            raise
        ran += time.monotonic() - t0
        if isinstance(result, ProgramResult):
            plan.running.remove(program)
            plan.accounting["programs"].append({"call_id": call_id, "status": result.status,
                                                "seconds": round(ran, 4)})
            out: dict[str, Any] = {"id": new_id("progout"), "type": "program_output", "call_id": call_id,
                                   "result": result.result, "status": result.status}
            if result.error:
                out["error"] = result.error
            plan.output.append(out)
            index = len(plan.output) - 1
            yield ev("response.output_item.added", output_index=index, item=out)
            yield ev("response.output_item.done", output_index=index, item=out)
            return
        plan.accounting["tool_calls"]["programmatic"] += len(result)
        for call in result:
            async for event in self._function_call(plan, ev, {"call_id": call.call_id, "name": call.name,
                                                              "arguments": call.arguments},
                                                   {"type": "program", "caller_id": call_id}):
                yield event
        plan.running.remove(program)
        self.pool.park(Parked(program, call_id, {c.call_id: c for c in result}, plan.rid, started, 0.0, ran,
                              plan.tenant))


async def _next(body: AsyncIterator[dict[str, Any]]) -> dict[str, Any] | None:
    """The body's next event, or None at its end (StopAsyncIteration cannot end a task's coroutine)."""
    try:
        return await anext(body)
    except StopAsyncIteration:
        return None


def mode_of(plan: Plan) -> str:
    """How the response spent its compute: ultra (sub-agents), max (a reasoning effort), programmatic
    (a program ran), or direct."""
    a = plan.accounting
    if a.get("ultra"):
        return "ultra"
    if plan.req.reasoning is not None and plan.req.reasoning.effort not in (None, "none"):
        return "max"
    if a["programs"] or a["tool_calls"]["programmatic"]:
        return "programmatic"
    return "direct"


def _waiting(plan: Plan) -> bool:
    """Whether the response ends on a program's calls, which the client owes outputs for."""
    last = plan.output[-1] if plan.output else None
    return last is not None and last["type"] == "function_call" and (last.get("caller") or {}).get("type") == "program"


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
