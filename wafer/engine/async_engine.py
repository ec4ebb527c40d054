"""The engine stepped on the server's event loop.

`run_engines` is a task on the loop that serves HTTP: between steps it takes new requests and
aborts, then steps every running sequence together and puts each request's outputs straight into
its asyncio queue; the handlers write them out before the next step. A request's queue may be
shared with others (the choices of one HTTP request), each item then tagged with the request's key.
A caller that stops reading (a client gone) aborts its requests, which ends them before the next step.

Why not a thread of its own, so that HTTP runs while a step computes (a step releases the GIL)?
The compute threads fill every core, and each of the hundreds of parallel regions in a step waits
for its slowest thread: HTTP work done during a step preempts one of them and delays the step by as
much as it would have taken between steps. A client on the same machine, woken by a write made
mid-step, then costs the step its own time too, where a write made between steps lets it read while
the engine prepares the next one. Tried: no gain in bench/server_decode.py, and per token 3-4
context switches of the loop thread (wake-ups, GIL hand-offs) against none here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wafer.config import EngineSettings
from wafer.engine.compute_threads import SIDE_WORK, ComputeThreads, binding_wanted
from wafer.engine.constraints import GrammarMatcher, GrammarTooCostly
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams, SequenceOutput
from wafer.engine.stats import EngineSnapshot

log = logging.getLogger("wafer.engine")


class EngineOverloaded(Exception):
    """Too many requests are already waiting."""


class EngineStopped(Exception):
    """The engine no longer admits requests (shutting down)."""


class EngineFailure(Exception):
    """A step failed inside the engine; the request cannot go on."""


class EngineUnavailable(EngineFailure):
    """A part of the engine is down (a pipeline stage): the request failed, and may be retried later."""


# A step longer than this is logged with what it held: the server's loop is held for as long, and
# every stream waits (issue 19 bounds that wait at 100 ms).
SLOW_STEP_SECONDS = 0.1
# At info, at most one slow step's line per this many seconds (vLLM's stats line comes as often): a
# busy machine makes several such steps a second. Every one is at debug, and wafer:engine_step_seconds
# counts them all.
SLOW_STEP_INFO_SECONDS = 10.0


@dataclass(frozen=True)
class StepTiming:
    """One engine step as the loop saw it: its wall time and what it computed."""

    seconds: float
    sequences: int
    prompt_tokens: int  # 0: a decode step
    # Scheduling and the forward pass, the rest of `seconds` picking the tokens (through pipeline
    # stages: since the step was sent, which may be before this call began).
    forward_seconds: float = 0.0
    mask_seconds: float = 0.0  # of picking the tokens, the grammars' masks (llguidance)
    mask_cpu_seconds: float = 0.0  # their CPU time, which the machine's other load does not inflate

    @property
    def kind(self) -> str:
        return "prompt" if self.prompt_tokens else "decode"


class SlowStepLog:
    """Logs each step over SLOW_STEP_SECONDS with what it computed: the first at info, then at most
    one every `interval` seconds at info, which counts the slow steps logged at debug since the line
    before it and names the longest; the others at debug. `clock`: seconds, monotonic."""

    def __init__(self, interval: float = SLOW_STEP_INFO_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._next_info = float("-inf")
        self._held = 0  # slow steps at debug since the last line at info
        self._longest = 0.0

    def __call__(self, step: StepTiming) -> None:
        if step.seconds <= SLOW_STEP_SECONDS:
            return
        now = self.clock()
        if now < self._next_info:
            self._held += 1
            self._longest = max(self._longest, step.seconds)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s", self.describe(step))
            return
        line = self.describe(step)
        if self._held:
            line += (f" [and {self._held} more slow step{'s' if self._held > 1 else ''} since the last such line, "
                     f"the longest {self._longest * 1000:.0f} ms; each at debug]")
        log.info("%s", line)
        self._next_info, self._held, self._longest = now + self.interval, 0, 0.0

    @staticmethod
    def describe(step: StepTiming) -> str:
        return (f"a {step.kind} step took {step.seconds * 1000:.0f} ms ({step.sequences} sequences, "
                f"{step.prompt_tokens} prompt tokens; the forward pass {step.forward_seconds * 1000:.0f} ms, picking "
                f"the tokens the rest, of which grammars' masks {step.mask_seconds * 1000:.0f} ms): every stream "
                f"waited as long")


@dataclass
class EngineRequest:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    tag: str = ""
    key: int | None = None  # set: items go into the queue as (key, item)
    seq_id: int | None = None
    arrived: float = field(default_factory=time.monotonic)
    background: bool = False  # batch work: runs where interactive requests leave room
    # When its work happened (time.monotonic(), plain data that the server's traces are built from
    # after the fact): first taken by a step, the step that gave its first token ended, it finished.
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class AsyncEngine:
    """One model's engine as the server, the router and the agents see it: the only way they reach
    it. Requests go in with `submit` and out through their queues, `abort` ends one, `stats` reports.
    These, like the task that steps it (`run_engines`), run on the one event loop; the checks of what
    a request asks (`validate`, the grammar methods) touch no engine state and run on any thread."""

    def __init__(self, engine: LLMEngine, max_waiting: int = EngineSettings.max_waiting) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake: asyncio.Event | None = None  # run_engines' own
        self._requests: dict[int, EngineRequest] = {}
        self._by_seq: dict[int, EngineRequest] = {}
        self._pending = 0  # submitted but not yet taken by a step
        self._rids = itertools.count()
        self.accepting = True
        self.failures = 0
        # Called on the loop after each step (the server's metrics); an observer must not raise.
        self.step_observers: list[Callable[[StepTiming], None]] = []
        self.slow_step_log = SlowStepLog()

    def _nudge(self) -> None:
        if self._wake is not None:
            self._wake.set()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def max_running(self) -> int:
        """The most sequences the engine runs at once."""
        return self.engine.scheduler.max_running

    @property
    def idle(self) -> bool:
        return self._pending == 0 and not self.engine.has_work

    def stats(self) -> EngineSnapshot:
        """The engine's figures now, requests submitted but not yet taken by a step counted as waiting."""
        snap = self.engine.snapshot()
        return dataclasses.replace(snap, waiting=snap.waiting + self._pending)

    # --- what a request may ask -----------------------------------------------------------------
    def validate(self, prompt_ids: list[int]) -> None:
        """Raises ValueError for a prompt the engine cannot take, whatever its load."""
        self.engine.check(prompt_ids)

    def is_special(self, text: str) -> bool:
        """Whether `text` is one special token of the model's tokenizer."""
        return self.engine.constraints.is_special(text)

    def check_grammar(self, grammar: str) -> None:
        """Raises GrammarError (a ValueError) for a grammar that cannot be compiled."""
        self.engine.constraints.check(grammar)

    def compile_grammar(self, grammar: str) -> GrammarMatcher:
        """A matcher for `grammar`, to pass as SamplingParams.compiled (each sequence gets a copy),
        with its completion from the start already searched (the caller prepares the request off the
        loop)."""
        matcher = self.engine.constraints.matcher(grammar)
        matcher.prime()
        return matcher

    # --- requests ---------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, tag: str = "",
               queue: asyncio.Queue | None = None, key: int | None = None,
               background: bool = False) -> EngineRequest:
        """Queue a request now (admission is decided here, not when its outputs are first read). Its
        outputs, and an exception if it fails, go into `queue` (a new one by default), as (key, item)
        when `key` is given: requests that share a queue are read by one consumer, with no task
        between the step and it. `background`: batch work, scheduled below interactive requests."""
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        if self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are already waiting")
        req = EngineRequest(next(self._rids), list(prompt_ids), params,
                            asyncio.Queue() if queue is None else queue, tag, key, background=background)
        self._pending += 1
        self._inbox.append(("add", req))
        self._nudge()
        return req

    def abort(self, req: EngineRequest) -> None:
        self._inbox.append(("abort", req))
        self._nudge()

    def stop_background(self) -> None:
        """End every background request now with EngineStopped, nothing of it delivered as an answer:
        batch lines are not cut short on shutdown but left to run again after a restart."""
        self._inbox.append(("stop_background", None))
        self._nudge()

    def finish_all(self, reason: str = "length") -> None:
        """End every live request now with a final output (used at the end of a graceful shutdown)."""
        self._inbox.append(("finish_all", reason))
        self._nudge()

    # --- stepping ---------------------------------------------------------------------------
    def _deliver(self, req: EngineRequest, item: object) -> None:
        req.queue.put_nowait(item if req.key is None else (req.key, item))

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                req = arg
                self._pending -= 1
                try:
                    seq = self.engine.add(req.prompt_ids, req.params, req.arrived, req.background)
                except ValueError as e:
                    self._deliver(req, e)
                    continue
                req.seq_id = seq.seq_id
                self._requests[req.rid] = req
                self._by_seq[seq.seq_id] = req
            elif kind == "abort":
                req = self._requests.pop(arg.rid, None)
                if req is not None and req.seq_id is not None:
                    self._by_seq.pop(req.seq_id, None)
                    self.engine.abort(req.seq_id)
            elif kind == "finish_all":
                self._finish_all(arg)
            elif kind == "stop_background":
                for req in [r for r in self._requests.values() if r.background]:
                    self._requests.pop(req.rid, None)
                    if req.seq_id is not None:
                        self._by_seq.pop(req.seq_id, None)
                        self.engine.abort(req.seq_id)
                    self._deliver(req, EngineStopped("the server is shutting down; this batch line runs again "
                                                     "after a restart"))

    def _finish_all(self, reason: str) -> None:
        for req in list(self._requests.values()):
            seq = self.engine.seqs.get(req.seq_id) if req.seq_id is not None else None
            n_out = len(seq.output_ids) if seq else 0
            text = seq.text[seq.emitted :] if seq else ""
            self.engine.abort(req.seq_id)  # type: ignore[arg-type]
            if n_out == 0 or req.background:  # never started (an empty "answer" would read as one), or batch
                # work, which runs again after a restart rather than be kept cut short: say it was not served
                self._deliver(req, EngineStopped("the server shut down before this request was served"))
                continue
            self._deliver(req, SequenceOutput(req.seq_id or -1, [], text, True, reason, [],
                                              seq.num_prompt if seq else 0, n_out, 0))
        self._requests.clear()
        self._by_seq.clear()

    def poll(self) -> bool:
        """One turn of the loop: take new requests and aborts, then step once if there is work.
        Returns whether it stepped."""
        self._drain_inbox()
        if not self.engine.has_work:
            return False
        prompt_before = self.engine.stats.prompt_tokens
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # the server must stay up: fail these requests, keep serving
            self._fail_running(e)
            return True
        stats = self.engine.stats
        self._timed(StepTiming(time.perf_counter() - started, stats.last_batch_size,
                               stats.prompt_tokens - prompt_before, stats.last_forward_seconds,
                               stats.last_mask_seconds, stats.last_mask_cpu_seconds))
        now = time.monotonic()
        for out in outputs:
            req = self._by_seq.get(out.seq_id)
            if req is None:
                continue
            if req.first_token is None and (out.new_token_ids or out.finished):
                req.first_token = now
                if out.queue_time is not None:
                    req.scheduled = req.arrived + out.queue_time
            if out.finished:
                req.finished = now
            if out.error is not None:  # this request alone failed in the step
                self.failures += 1
                log.error("request %s failed in the engine: %s", req.tag, out.error)
                if out.error.startswith("StageFailure"):
                    self._deliver(req, EngineUnavailable(out.error.partition(": ")[2]))
                elif out.error.startswith(GrammarTooCostly.__name__):  # the request's own: its client hears why
                    self._deliver(req, GrammarTooCostly(out.error.partition(": ")[2]))
                else:
                    self._deliver(req, EngineFailure(f"internal engine error ({out.error.partition(':')[0]})"))
            else:
                self._deliver(req, out)
            if out.finished:
                self._by_seq.pop(out.seq_id, None)
                self._requests.pop(req.rid, None)
        return True

    def _timed(self, step: StepTiming) -> None:
        self.slow_step_log(step)
        for observe in self.step_observers:
            observe(step)

    def close(self) -> None:
        """Release what the engine holds outside this process (pipeline stages)."""
        self.engine.close()

    def fail_all(self, error: BaseException) -> None:
        """Fail every request, waiting or running, and admit no more: nothing steps this engine now."""
        self.accepting = False
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                self._pending -= 1
                self._deliver(arg, _failure(error))
        self._fail_running(error)

    def _fail_running(self, error: BaseException) -> None:
        self.failures += 1
        tags = [r.tag for r in self._requests.values()]
        log.exception("engine step failed; failing requests %s", ", ".join(tags) or "(none)", exc_info=error)
        for req in list(self._requests.values()):
            if req.seq_id is not None:
                self.engine.abort(req.seq_id)
            self._deliver(req, _failure(error))
        self._requests.clear()
        self._by_seq.clear()


def _failure(error: BaseException) -> EngineFailure:
    return EngineFailure(f"internal engine error ({type(error).__name__})")


def _after_io() -> asyncio.Future[None]:
    """Done two turns of the loop from now. In the first, the handlers woken by the step write its
    tokens out (their wake-ups were queued before) and the loop reads its sockets: a client gone
    wakes its handler, which in the second turn aborts its requests, before the next step drains
    them. With a single turn (sleep(0)) the next step would come before that handler and compute
    for a client that is gone."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(loop.call_soon, lambda: done.done() or done.set_result(None))  # done: cancelled
    return done


async def run_engines(engines: list[AsyncEngine]) -> None:
    """Step the engines on this event loop until cancelled, one after another (two stepping at once
    would oversubscribe the cores). Between steps the loop turns, so that the handlers write out what
    the step produced; with nothing to do it sleeps until a request comes."""
    import torch

    wake = asyncio.Event()
    for e in engines:
        e._wake = wake
    # This thread's compute workers: idle between steps, so that what the HTTP work wakes (a client
    # on this machine) takes their core rather than this thread's, and each on a core of its own
    # (see compute_threads.py).
    full = torch.get_num_threads()
    threads = full
    workers = ComputeThreads(full, bind=binding_wanted())
    SIDE_WORK.stepping_cpu = workers.cpu
    try:
        while True:
            busy = False
            if (want := SIDE_WORK.step_begins(full)) != threads:  # requests being prepared take a core
                torch.set_num_threads(want)
                threads = want
            workers.busy()
            with torch.inference_mode():  # entered per turn: the mode must not leak into the handlers
                try:
                    for e in engines:
                        busy |= e.poll()
                finally:
                    SIDE_WORK.step_ends()
            workers.idle()
            if busy:
                await _after_io()
            else:
                await wake.wait()
                wake.clear()
    finally:
        SIDE_WORK.stepping_cpu = None
        workers.close()
        if threads != full:
            torch.set_num_threads(full)
        for e in engines:
            e._wake = None
