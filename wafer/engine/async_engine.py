"""The engine in a thread of its own, driven from asyncio.

One thread owns the model and the cores: it takes new requests and aborts between steps, steps
every running sequence together, and hands each request's outputs to its asyncio queue. Callers
see an async iterator per sequence; leaving it early (a client gone) aborts the sequence, which
the loop carries out before its next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams, SequenceOutput

log = logging.getLogger("wafer.engine")


class EngineOverloaded(Exception):
    """Too many requests are already waiting."""


class EngineStopped(Exception):
    """The engine no longer admits requests (shutting down)."""


class EngineFailure(Exception):
    """A step failed inside the engine; the request cannot go on."""


@dataclass
class EngineRequest:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: str = ""
    seq_id: int | None = None
    arrived: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 64, step_lock: threading.Lock | None = None) -> None:
        self.engine = engine
        # Engines of several models in one process take turns: two stepping at once would
        # oversubscribe the cores, which costs far more than waiting.
        self._step_lock = step_lock or threading.Lock()
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[int, EngineRequest] = {}  # engine thread only
        self._by_seq: dict[int, EngineRequest] = {}  # engine thread only
        self._pending = 0  # submitted but not yet taken by the engine thread
        self._pending_lock = threading.Lock()
        self._rids = itertools.count()
        self._stop = False
        self.accepting = True
        self.failures = 0
        self._thread = threading.Thread(target=self._loop, name="wafer-engine", daemon=True)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def idle(self) -> bool:
        return self._pending == 0 and not self.engine.has_work

    # --- requests ---------------------------------------------------------------------------
    async def stream(self, req: EngineRequest) -> AsyncIterator[SequenceOutput]:
        """The outputs of a submitted request; leaving early aborts it."""
        finished = False
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(req)

    def submit(self, prompt_ids: list[int], params: SamplingParams, tag: str = "") -> EngineRequest:
        """Queue a request now (admission is decided here, not when its stream is first read)."""
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        if self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are already waiting")
        req = EngineRequest(next(self._rids), list(prompt_ids), params, asyncio.get_running_loop(), asyncio.Queue(), tag)
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def abort(self, req: EngineRequest) -> None:
        self._inbox.put(("abort", req))
        self._wake.set()

    def finish_all(self, reason: str = "length") -> None:
        """End every live request now with a final output (used at the end of a graceful shutdown)."""
        self._inbox.put(("finish_all", reason))
        self._wake.set()

    # --- the engine thread ------------------------------------------------------------------
    def _deliver(self, req: EngineRequest, item: object) -> None:
        req.loop.call_soon_threadsafe(req.queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req = arg
                with self._pending_lock:
                    self._pending -= 1
                try:
                    seq = self.engine.add(req.prompt_ids, req.params, req.arrived)
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

    def _finish_all(self, reason: str) -> None:
        for req in list(self._requests.values()):
            seq = self.engine.seqs.get(req.seq_id) if req.seq_id is not None else None
            n_out = len(seq.output_ids) if seq else 0
            text = seq.text[seq.emitted :] if seq else ""
            self.engine.abort(req.seq_id)  # type: ignore[arg-type]
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
        try:
            with self._step_lock:
                outputs = self.engine.step()
        except Exception as e:  # the server must stay up: fail these requests, keep serving
            self._fail_running(e)
            return True
        for out in outputs:
            req = self._by_seq.get(out.seq_id)
            if req is None:
                continue
            self._deliver(req, out)
            if out.finished:
                self._by_seq.pop(out.seq_id, None)
                self._requests.pop(req.rid, None)
        return True

    def _loop(self) -> None:
        drive([self], lambda: self._stop)

    def _fail_running(self, error: Exception) -> None:
        self.failures += 1
        tags = [r.tag for r in self._requests.values()]
        log.exception("engine step failed; failing requests %s", ", ".join(tags) or "(none)", exc_info=error)
        for req in list(self._requests.values()):
            if req.seq_id is not None:
                self.engine.abort(req.seq_id)
            self._deliver(req, EngineFailure(f"internal engine error ({type(error).__name__})"))
        self._requests.clear()
        self._by_seq.clear()


def drive(engines: list[AsyncEngine], should_stop: Callable[[], bool]) -> None:
    """Run engines on the calling thread until should_stop(): the thread that loaded the models
    should be the one that steps them (measured here: stepping from a second thread while the first
    has its own OpenMP team costs a quarter of the decode speed)."""
    import torch

    wake = threading.Event()
    for e in engines:
        e._wake = wake
    with torch.inference_mode():
        while not should_stop():
            busy = False
            for e in engines:
                busy |= e.poll()
            if not busy:
                wake.wait(0.05)
                wake.clear()
