"""The shared half of the OpenAI endpoints: from a validated request to engine sequences, and from
their outputs to usage, logprobs and server-sent events."""


from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from wafer.engine.async_engine import (
    SIDE_WORK,
    AsyncEngine,
    EngineFailure,
    EngineOverloaded,
    EngineRequest,
    EngineStopped,
    EngineUnavailable,
)
from wafer.engine.constraints import GrammarTooCostly
from wafer.engine.sequence import SamplingParams, SequenceOutput, TokenLogprob
from wafer.models.chat_template import ChatTemplate
from wafer.models.generation_defaults import NEUTRAL
from wafer.models.tokenizer import TextTokenizer
from wafer import tracing
from wafer.config import REASONING_BUDGETS
from wafer.server.caller import current_caller
from wafer.server.errors import APIError, bad_request, server_error
from wafer.server.metrics import RequestTimer, ServerMetrics
from wafer.server.protocol import _Sampling

log = logging.getLogger("wafer.server")


def _shutting_down(e: Exception) -> APIError:
    return APIError(503, f"The server is shutting down ({e}).", "server_error", None, "unavailable",
                    {"Retry-After": "5"})


def _too_costly(e: GrammarTooCostly) -> APIError:
    """The request's schema cost the engine more than its grammar budget: its own error, a 400."""
    return bad_request(str(e), None, "grammar_too_costly")


def _unavailable(e: Exception, rid: str) -> APIError:
    log.error("request %s failed: %s", rid, e)
    return APIError(503, f"The model is unavailable: {e}; retry shortly (request id {rid}).",
                    "server_error", None, "stage_failure", {"Retry-After": "5", "x-request-id": rid})
_PING = object()  # put in a request's queue when ping_interval passes without an output
TEXT_HOLE = "\x00wafer-text\x00"  # stands for a chunk's text in a pre-rendered event


# Set in a Batch API line's task (and so in the tasks it starts): its sequences are background work,
# which the engine schedules only where interactive requests leave room.
BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("wafer_background", default=False)


# A request body larger than this has its preparation (routing, template, tokenizing, grammar) done
# in a worker thread: that work grows with the input, and on the loop it would hold every stream.
OFF_LOOP_BYTES = 16 * 1024


# Threads that prepare heavy requests: half the cores at most, so that however many arrive at once
# the engine's steps keep the other half (each preparation running takes a compute thread's core,
# SIDE_WORK); the rest wait their turn, as the work they queue for is theirs.
_PREPARERS = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="wafer-prepare")


async def off_loop(heavy: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, in a preparing thread when `heavy`, counted as side work so that the engine's
    steps leave it a core meanwhile; small requests skip the thread hop."""
    if not heavy:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_PREPARERS, functools.partial(_beside_steps, fn, *args))


def _beside_steps(fn: Callable[..., Any], *args: Any) -> Any:
    with SIDE_WORK.running():
        return fn(*args)


async def unless_disconnect(consume: Awaitable[None], request: Request, abort: Callable[[], None] | None = None) -> bool:
    """Run `consume` to its end, or until the client goes (then `abort`, and False). An error of
    `consume` is raised here."""

    async def watch() -> None:
        # The body was read: what receive() gives now is the disconnect, the moment it is known.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if abort is not None:
            abort()

    work = asyncio.ensure_future(consume)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if not work.done() or work.cancelled():
        return False
    work.result()
    return True


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def text_event(obj: dict[str, Any]) -> Callable[[str], str]:
    """`sse` of `obj` as a function of its one string field that holds `TEXT_HOLE`: the rest is
    serialised once per stream, not once per token."""
    before, after = sse(obj).split(json.dumps(TEXT_HOLE, ensure_ascii=False))
    return lambda text: before + json.dumps(text, ensure_ascii=False) + after


@dataclass
class ServedModel:
    """A model as the HTTP layer sees it: names, engine, tokenizer, limits."""

    names: list[str]
    engine: AsyncEngine
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    max_model_len: int
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    ping_interval: float = 10.0
    metrics: ServerMetrics | None = None
    # what a request gets for a sampling parameter it leaves out: every key of NEUTRAL
    sampling_defaults: dict[str, float] = field(default_factory=lambda: dict(NEUTRAL))
    # the compute path, what runs its matrix products, and a warning where that is not the fastest
    compute: dict[str, str | None] = field(default_factory=dict)
    # reasoning tokens per reasoning_effort level (wafer.toml's [reasoning])
    reasoning: dict[str, int] = field(default_factory=lambda: dict(REASONING_BUDGETS))
    # tool calls generated under their grammar; off (bench/bfcl.py's comparison), the calls are the
    # model's own text, parsed
    tool_grammar: bool = True


@dataclass
class _Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    cached: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Phase:
    """One of the engine requests that answer one HTTP request in turn (a reasoning turn, then the
    answer): they share one timer, and the last finishes it with the tokens of all."""

    timer: RequestTimer | None
    last: bool = False
    earlier_tokens: int = 0  # generated by the phases before


def _finish(reason: str | None) -> str | None:
    return "length" if reason == "abort" else reason


class GenerationHandler:
    """What chat and legacy completions share: parameters, limits, submission, merging the
    choices' streams, collecting them, usage, SSE."""

    def __init__(self, served: ServedModel) -> None:
        self.m = served

    # --- shared -------------------------------------------------------------------------------
    def _params(self, req: _Sampling, limit: int, seed_offset: int, logprobs: int | None) -> SamplingParams:
        vocab = self.m.tokenizer.vocab_size
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            tid = int(key)
            if not 0 <= tid < vocab:
                raise bad_request(f"logit_bias token id {tid} is outside the vocabulary (0..{vocab - 1})", "logit_bias")
            bias[tid] = value
        d = self.m.sampling_defaults  # the model's, for what the request leaves out (as vLLM)
        for tid in req.stop_token_ids or []:
            if not 0 <= tid < vocab:
                raise bad_request(f"stop_token_ids: {tid} is outside the vocabulary", "stop_token_ids")
        return SamplingParams(
            max_tokens=limit,
            temperature=d["temperature"] if req.temperature is None else req.temperature,
            top_p=d["top_p"] if req.top_p is None else req.top_p,
            top_k=int(d["top_k"]) if req.top_k is None else req.top_k,
            min_p=d["min_p"] if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=d["repetition_penalty"] if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias or None,
            seed=None if req.seed is None else req.seed + seed_offset,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_lookup=req.prompt_lookup,
            cache_key=req.prompt_cache_key,
        )

    def _encode(self, text: str, param: str, special: bool = True) -> list[int]:
        """The text's tokens; a text too long to fit the context whatever its tokens is refused before
        it is tokenized, which for megabytes takes seconds of a core."""
        widest = self.m.tokenizer.max_token_chars
        if len(text) > self.m.max_model_len * widest:
            ctx = self.m.max_model_len
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, your {param} "
                           f"has {len(text)} characters, which is more than {ctx} tokens of at most {widest} "
                           f"characters each. Please reduce the length of the {param}.", "invalid_request_error",
                           param, "context_length_exceeded")
        return self.m.tokenizer.encode(text, add_special_tokens=special)

    def _limit(self, prompt_len: int, requested: int | None, param: str) -> int:
        ctx = self.m.max_model_len
        if requested is None:
            requested = ctx - prompt_len
        if prompt_len + requested > ctx or requested < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + max(requested, 0)} tokens ({prompt_len} in the {param}, {max(requested, 0)} in the "
                f"completion). Please reduce the length of the {param} or completion.",
                "invalid_request_error",
                param,
                "context_length_exceeded",
            )
        return requested

    def _submit(self, jobs: list[tuple[list[int], SamplingParams]], rid: str, param: str = "n") -> list[EngineRequest]:
        """Queue every choice of a request; `param` names what made them many, for the 400 of a
        request that has more than the engine's whole queue could ever admit at once."""
        limit = self.m.engine.max_waiting
        if len(jobs) > limit:  # never admitted, however idle the server: not a 429 to retry
            raise bad_request(f"This request asks for {len(jobs)} completions; this server queues at most {limit} at "
                              f"once (--max-waiting). Ask for fewer.", param)
        for ids, _ in jobs:
            try:
                self.m.engine.validate(ids)
            except ValueError as e:
                raise bad_request(str(e)) from None
        reqs: list[EngineRequest] = []
        # Several choices share one queue, each output tagged with its choice's index.
        shared = asyncio.Queue() if len(jobs) > 1 else None
        background = BACKGROUND.get()
        try:
            for i, (ids, params) in enumerate(jobs):
                reqs.append(self.m.engine.submit(ids, params, tag=rid, queue=shared,
                                                 key=None if shared is None else i, background=background))
        except EngineOverloaded as e:
            for r in reqs:
                self.m.engine.abort(r)
            raise APIError(429, f"The server is overloaded ({e}); retry shortly.", "rate_limit_error", None,
                           "rate_limit_exceeded", {"Retry-After": "1"}) from None
        except EngineStopped as e:
            for r in reqs:
                self.m.engine.abort(r)
            raise _shutting_down(e) from None
        return reqs

    def _timer(self) -> RequestTimer | None:
        return self.m.metrics.request(self.m.names[0]) if self.m.metrics else None

    async def _merge(self, streams: list[EngineRequest], n_prompt: int, ping: float | None = None,
                     phase: Phase | None = None) -> AsyncIterator[tuple[int, Any] | None]:
        """(choice index, output or exception) from all requests as they come, timed for the
        metrics; with `ping`, None after a quiet spell of `ping` to 2 `ping` seconds. Leaving early
        aborts every request that has not finished. Per token this costs a queue hop and no task or
        timer: at a few milliseconds a token, tasks made per item cost a tenth of the speed. The
        requests were submitted onto one queue (see `_submit`), so the outputs of a step reach this
        consumer in the loop turn that follows it, however many choices there are."""
        engine = self.m.engine
        timer = self._timer() if phase is None else phase.timer
        span = tracing.current()
        last: dict[int, SequenceOutput] = {}
        q, single = streams[0].queue, len(streams) == 1
        loop = asyncio.get_running_loop()
        taken = 0
        ticker: asyncio.TimerHandle | None = None

        def tick(seen: int) -> None:
            # One timer per request, not one per token: it pings when nothing came since its last look.
            nonlocal ticker
            if taken == seen:
                q.put_nowait(_PING)
            ticker = loop.call_later(ping, tick, taken)  # type: ignore[arg-type]

        if ping is not None:
            ticker = loop.call_later(ping, tick, taken)
        completed = False
        try:
            done = 0
            while done < len(streams):
                got = await q.get()
                if got is _PING:
                    yield None
                    continue
                taken += 1
                i, item = (0, got) if single else got
                if isinstance(item, Exception) or item.finished:
                    done += 1
                if timer is not None and not isinstance(item, Exception):
                    timer.tokens(len(item.new_token_ids))
                    last[i] = item
                yield i, item
                if timer is not None:
                    timer.delivered()  # a stream's consumer resumes this once it wrote the item out
            if timer is not None and len(last) == len(streams) and (phase is None or phase.last):
                first = last[0]
                timer.finish(_finish(first.finish_reason), n_prompt, sum(o.num_output_tokens for o in last.values())
                             + (phase.earlier_tokens if phase else 0), first.queue_time)
            completed = True
        finally:
            if timer is not None and (not completed or phase is None or phase.last):
                # Cut short (the client went, a failure): what was computed is charged all the same.
                timer.charge(n_prompt, sum(o.num_output_tokens for o in last.values())
                             + (phase.earlier_tokens if phase else 0))
            if ticker is not None:
                ticker.cancel()
            for r in streams:
                engine.abort(r)  # a no-op for finished ones
            if span is not None:
                self._trace(span, streams, n_prompt, last, phase)

    @staticmethod
    def _trace(span: tracing.Span, streams: list[EngineRequest], n_prompt: int, last: dict[int, SequenceOutput],
               phase: Phase | None) -> None:
        """The request's usage and finish reasons on its span, and the engine's work under it."""
        tracing.engine_spans(span, streams, time.monotonic())
        if phase is None or phase.last:
            # a choice cut short (the client went, a failure) is said to have been aborted
            reasons = [(_finish(last[i].finish_reason) if i in last and last[i].finished else None) or "abort"
                       for i in range(len(streams))]
            span.set({tracing.INPUT_TOKENS: n_prompt, tracing.FINISH_REASONS: reasons,
                      tracing.OUTPUT_TOKENS: sum(o.num_output_tokens for o in last.values())
                      + (phase.earlier_tokens if phase else 0),
                      "wafer.cached_tokens": max((o.num_cached_tokens for o in last.values()), default=0)})

    def _aborter(self, streams: list[EngineRequest]) -> Callable[[], None]:
        """Abort every choice of a request (those finished already are left alone)."""
        engine = self.m.engine

        def abort() -> None:
            for r in streams:
                engine.abort(r)

        return abort

    async def _collect(self, streams: list[EngineRequest], request: Request, rid: str,
                       n_prompt: int) -> list[_Choice] | None:
        """Run all choices to the end; None if the client went away (its sequences are aborted)."""
        choices = [_Choice(i) for i in range(len(streams))]

        async def consume() -> None:
            async for i, out in self._merge(streams, n_prompt):
                self._fold(choices[i], out, rid)

        return choices if await unless_disconnect(consume(), request, self._aborter(streams)) else None

    def _fold(self, c: _Choice, out: Any, rid: str) -> None:
        if isinstance(out, GrammarTooCostly):
            raise _too_costly(out)
        if isinstance(out, EngineUnavailable):
            raise _unavailable(out, rid)
        if isinstance(out, EngineFailure):
            log.error("request %s failed in the engine: %s", rid, out)
            raise server_error("The engine failed while processing the request.", rid)
        if isinstance(out, ValueError):
            raise bad_request(str(out))
        if isinstance(out, EngineStopped):
            raise _shutting_down(out)
        if isinstance(out, Exception):
            log.error("request %s failed: %r", rid, out)
            raise server_error("Internal error.", rid)
        c.text += out.text
        c.tokens = out.num_output_tokens
        c.cached = out.num_cached_tokens
        c.logprobs.extend(out.logprobs)
        c.token_ids.extend(out.new_token_ids)
        if out.finished:
            c.finish_reason = _finish(out.finish_reason)

    def _usage(self, prompt_tokens: int, choices: list[_Choice], reasoning: int = 0) -> dict[str, Any]:
        """`reasoning`: tokens of a reasoning turn, which count among the completion's (as OpenAI's)."""
        completion = sum(c.tokens for c in choices) + reasoning
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": max((c.cached for c in choices), default=0)},
            "completion_tokens_details": {"reasoning_tokens": reasoning, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0},
        }

    def _token_text(self, tid: int) -> tuple[str, list[int]]:
        b = self.m.tokenizer.token_bytes(tid)
        return b.decode("utf-8", errors="replace"), list(b)

    def _error_event(self, e: Exception, rid: str) -> str:
        if isinstance(e, GrammarTooCostly):
            e = _too_costly(e)
        if self.m.metrics is not None:  # the HTTP status was 200 already; count what it would have been
            self.m.metrics.error(e.status if isinstance(e, APIError) else 500, self.m.names[0])
            self.m.metrics.tenant_error(current_caller(), e.status if isinstance(e, APIError) else 500)
        if isinstance(e, APIError):
            return sse(e.body())
        if isinstance(e, EngineStopped):
            return sse(_shutting_down(e).body())
        if isinstance(e, EngineUnavailable):
            return sse(_unavailable(e, rid).body())
        if isinstance(e, EngineFailure):
            log.error("request %s failed in the engine mid-stream: %s", rid, e)
            return sse(server_error("The engine failed while processing the request.", rid).body())
        log.error("request %s failed mid-stream: %r", rid, e)
        return sse(server_error("Internal error.", rid).body())

    async def _sse_stream(self, streams: list[EngineRequest], head: dict[str, Any], n_prompt: int,
                          include_usage: bool, opening: list[str],
                          render: Callable[[_Choice, SequenceOutput, int], list[str]]) -> AsyncIterator[str]:
        """The event stream both endpoints share: opening chunks; for each output, what `render`
        makes of it (given the choice and its text length before); pings while waiting; an error
        event on failure; the usage chunk when asked; [DONE]."""
        choices = [_Choice(i) for i in range(len(streams))]
        for line in opening:
            yield line
        try:
            async for item in self._merge(streams, n_prompt, self.m.ping_interval):
                if item is None:
                    yield ": ping\n\n"
                    continue
                i, out = item
                if isinstance(out, Exception):
                    yield self._error_event(out, head["id"])
                    return
                c = choices[i]
                offset = len(c.text)
                self._fold(c, out, head["id"])
                for line in render(c, out, offset):
                    yield line
        except APIError as e:
            yield self._error_event(e, head["id"])
            return
        if include_usage:
            yield sse({**head, "choices": [], "usage": self._usage(n_prompt, choices)})
        yield "data: [DONE]\n\n"
