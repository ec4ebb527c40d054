"""`reasoning_effort` on chat completions: a reasoning turn within its budget, then the answer
(wafer/server/reasoning.py holds the budgets and the prompts; this is the flow through the engine)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from wafer.engine.async_engine import EngineRequest
from wafer.engine.sequence import SamplingParams, SequenceOutput
from wafer.server import reasoning
from wafer.server.errors import APIError, bad_request
from wafer.server.generation import GenerationHandler, Phase, _Choice, off_loop, sse, unless_disconnect
from wafer.server.protocol import ChatCompletionRequest
from wafer.server.reasoning import ReasoningPlan
from wafer.server.streaming import EventStreamResponse
from wafer.server.tools import CallParser

log = logging.getLogger("wafer.server")


class ReasonedChat(GenerationHandler):
    """The reasoning half of ChatHandler, which provides the `_messages`, `_render`, `_constraints`,
    `_choice` and `_chat_logprobs` used here."""

    def _plan(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str | None, Any, ReasoningPlan]:
        tools, grammar, compiled, choice = self._constraints(req)
        messages = self._messages(req)
        effort = req.reasoning_effort or "none"
        if reasoning.thinks_natively(self.m.chat_template.source):
            return tools, grammar, compiled, self._native_plan(req, effort, messages, tools, choice)
        return tools, grammar, compiled, self._turn_plan(req, effort, messages, tools, choice)

    def _encoded(self, text: str) -> list[int]:
        return self._encode(text, "messages", special=False)

    def _native_plan(self, req: ChatCompletionRequest, effort: str, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> ReasoningPlan:
        """The model thinks in its own `<think>` block, switched on by its template (and off for
        `none`, or when the output limit leaves no budget)."""
        if reasoning.level(effort) != "none":
            ids = self._encoded(reasoning.opened(self._render(messages, tools, choice, enable_thinking=True)))
            limit = self._limit(len(ids), req.output_limit, "messages")
            budget = reasoning.budget(effort, self.m.reasoning, limit)
            if budget > 0:
                return ReasoningPlan(effort, budget, limit, ids, ids, [], self._encoded(reasoning.FORCED_CLOSE), True)
        ids = self._encoded(self._render(messages, tools, choice, enable_thinking=False))
        return ReasoningPlan(effort, 0, self._limit(len(ids), req.output_limit, "messages"), [], ids, [], [], True)

    def _turn_plan(self, req: ChatCompletionRequest, effort: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> ReasoningPlan:
        """A model that does not think natively gets a turn of its own to reason in, asked for by a
        system note after the conversation, and answers with that turn in its history. The answer's
        prompt starts with the reasoning turn's, so the prefix cache serves it."""
        if reasoning.level(effort) != "none":
            think = [*messages, {"role": "system", "content": reasoning.THINK_NOTE}]
            text = self._render(think, tools, choice)
            before, slot, after = self._render([*think, {"role": "assistant", "content": reasoning.SLOT},
                                                {"role": "system", "content": reasoning.ANSWER_NOTE}],
                                               tools, choice).partition(reasoning.SLOT)
            if slot and reasoning.SLOT not in after:
                ids = self._encoded(text)
                head = ids if before == text else self._encoded(before)
                tail = self._encoded(after)
                limit = self._limit(len(head) + len(tail), req.output_limit, "messages")
                budget = reasoning.budget(effort, self.m.reasoning, limit)
                if budget > 0:
                    return ReasoningPlan(effort, budget, limit, ids, head, tail, [], False)
            else:
                log.warning("the chat template does not keep an assistant message's text as it is; "
                            "reasoning_effort %s answers without a reasoning turn", effort)
        ids = self._encoded(self._render(messages, tools, choice))
        return ReasoningPlan(effort, 0, self._limit(len(ids), req.output_limit, "messages"), [], ids, [], [], False)

    async def _reasoned(self, req: ChatCompletionRequest, request: Request,
                        heavy: bool) -> JSONResponse | EventStreamResponse:
        if req.n > 1:
            raise bad_request("With reasoning_effort, n must be 1 (each choice would need a reasoning turn of "
                              "its own).", "n")
        tools, grammar, compiled, plan = await off_loop(heavy, self._plan, req)
        lp = (req.top_logprobs or 0) if req.logprobs else None
        think = self._params(req, max(plan.budget, 1), 0, None)
        # The reasoning is free text: the request's stops and grammar are the answer's.
        think.stop, think.stop_token_ids = ([reasoning.CLOSE] if plan.native else []), []
        close = self.m.tokenizer.encode(reasoning.CLOSE, add_special_tokens=False)
        if plan.native and len(close) == 1:
            think.stop_token_ids = close
        answer = self._params(req, plan.limit, 0, lp)
        answer.grammar, answer.compiled = grammar, compiled
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": req.model, "system_fingerprint": self.m.fingerprint}
        # The first request is queued now, so that an overloaded or stopping server answers 429 or 503
        # before a stream starts; the answer's follows the reasoning.
        live = self._submit([(plan.think_ids, think) if plan.budget else (plan.before, answer)], rid)
        run = _Reasoning()
        ping = self.m.ping_interval if req.stream else None
        outputs = self._reason_then_answer(plan, think, answer, rid, live, run, ping)
        if req.stream:
            return EventStreamResponse(self._reasoned_stream(outputs, run, plan, head, req.include_usage,
                                                             lp is not None, bool(tools)),
                                       on_disconnect=self._aborter(live))
        thought, c = _Choice(0), _Choice(0)

        async def consume() -> None:
            async for item in outputs:
                kind, out = item  # type: ignore[misc]
                self._fold(thought if kind == "reasoning" else c, out, rid)

        if not await unless_disconnect(consume(), request, self._aborter(live)):
            return JSONResponse({}, status_code=499)
        c.text, c.cached = c.text.lstrip(), run.cached
        choice = self._choice(c, lp is not None, bool(tools))
        if plan.budget:
            choice["message"]["reasoning_content"] = thought.text
        return JSONResponse({
            **{"id": rid, "object": "chat.completion"}, **head,
            "choices": [choice],
            "usage": self._usage(run.prompt_tokens, [c], run.tokens),
            "service_tier": "default",
        }, headers={"x-request-id": rid})

    async def _reason_then_answer(self, plan: ReasoningPlan, think: SamplingParams, answer: SamplingParams,
                                  rid: str, live: list[EngineRequest], run: _Reasoning,
                                  ping: float | None) -> AsyncIterator[tuple[str, Any] | None]:
        """("reasoning" or "answer", an output or exception) as the engine makes them, None for a
        ping. The reasoning turn stops at its budget or at `</think>`; the answer is then a second
        request whose prompt holds the reasoning (closed by force when the budget ended it). A hook
        in the engine could append the close tag to the running sequence instead, but the engine
        would then have to know about thinking; this way it is two ordinary requests, and the prefix
        cache makes the second one's prompt nearly free (the reasoning turn's slot stays warm)."""
        timer = self._timer()
        eos = self.m.tokenizer.eos_ids
        generated: list[int] = []
        closed = False
        if plan.budget:
            async for item in self._merge(live[-1:], plan.prompt_tokens, ping, Phase(timer)):
                if item is None:
                    yield None
                    continue
                out = item[1]
                if isinstance(out, Exception):
                    yield "reasoning", out
                    return
                generated.extend(out.new_token_ids)
                run.cached = out.num_cached_tokens
                if out.finished:
                    closed = out.finish_reason == "stop" and not (generated and generated[-1] in eos)
                yield "reasoning", out
        then = plan.answer_prompt(generated, closed, eos)
        run.tokens, run.prompt_tokens = then.reasoning_tokens, then.prompt_tokens
        if self.m.metrics is not None:
            self.m.metrics.reasoning(self.m.names[0], plan.effort, run.tokens)
        if plan.budget:
            room = min(plan.limit - run.tokens, self.m.max_model_len - len(then.ids))
            if room < 1 or not self.m.engine.accepting:  # no answer can follow (a shutdown, or a full context)
                if timer is not None:
                    timer.finish("length", run.prompt_tokens, run.tokens, None)
                yield "answer", SequenceOutput(-1, [], "", True, "length", [], len(then.ids), 0, 0)
                return
            answer.max_tokens = room
            live.extend(self._submit([(then.ids, answer)], rid))
        async for item in self._merge(live[-1:], run.prompt_tokens, ping, Phase(timer, True, run.tokens)):
            if item is None:
                yield None
                continue
            if not plan.budget and not isinstance(item[1], Exception):
                run.cached = item[1].num_cached_tokens
            yield "answer", item[1]

    async def _reasoned_stream(self, outputs: AsyncIterator[tuple[str, Any] | None], run: _Reasoning,
                               plan: ReasoningPlan, head: dict[str, Any], include_usage: bool, want_lp: bool,
                               tools: bool) -> AsyncIterator[str]:
        """Reasoning as `reasoning_content` deltas (as vLLM streams it), then the answer as `content`
        (and tool calls), then the usage with its reasoning tokens."""
        base = {"id": head["id"], "object": "chat.completion.chunk", **head}

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
            obj = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return sse(obj)

        thought, c = _Choice(0), _Choice(0)
        parser = CallParser() if tools else None
        leading = True  # blanks before the answer's first character are dropped (a closed thought ends in them)
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for item in outputs:
                if item is None:
                    yield ": ping\n\n"
                    continue
                kind, out = item
                if isinstance(out, Exception):
                    yield self._error_event(out, head["id"])
                    return
                if kind == "reasoning":
                    self._fold(thought, out, head["id"])
                    if out.text:
                        yield chunk({"reasoning_content": out.text})
                    continue
                self._fold(c, out, head["id"])
                text = out.text
                if leading:
                    text = text.lstrip()
                    leading = not text
                lps = self._chat_logprobs(out.logprobs) if want_lp and out.logprobs else None
                deltas = parser.feed(text, final=out.finished) if parser else ([{"content": text}] if text else [])
                if lps is not None and not deltas:
                    deltas = [{"content": ""}]
                for k, delta in enumerate(deltas):
                    yield chunk(delta, None, lps if k == 0 else None)
                if out.finished:
                    finish = c.finish_reason
                    if parser is not None and parser.calls and finish == "stop":
                        finish = "tool_calls"
                    yield chunk({}, finish)
        except APIError as e:
            yield self._error_event(e, head["id"])
            return
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        if include_usage:
            c.cached = run.cached
            yield sse({**base, "choices": [], "usage": self._usage(run.prompt_tokens, [c], run.tokens)})
        yield "data: [DONE]\n\n"


@dataclass
class _Reasoning:
    """What a reasoning turn spent, known once it ends."""

    tokens: int = 0  # reasoning tokens
    prompt_tokens: int = 0  # what the answer read but the reasoning
    cached: int = 0  # prompt tokens the first request found in the prefix cache
