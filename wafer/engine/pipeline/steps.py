"""The engine's Executor over pipeline stages: up to one step per stage in flight, each over other
sequences, their logits taken back in the order they went out. A step that raised on a stage runs
again one sequence at a time; a stage that is gone raises StageFailure, and the engine fails the
running sequences (their KV is lost with it) and restarts the stages."""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from wafer.engine.executor import Fail, Flight
from wafer.engine.pipeline.executor import PipelineExecutor
from wafer.engine.pipeline.spec import StageError
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence, SequenceOutput

log = logging.getLogger("wafer.engine")


def argmax_only(seq: Sequence) -> bool:
    """Whether this sequence's next tokens are its logits' argmax and nothing else of them is read."""
    p = seq.params
    return p.greedy and not p.needs_processing and p.logprobs is None and seq.matcher is None


class PipelineSteps:
    def __init__(self, pipe: PipelineExecutor, fail: Fail, threads_before: int) -> None:
        """`threads_before`: this process's compute threads before it took a stage's share (restored at close)."""
        self.pipe = pipe
        self.fail = fail
        self.depth = pipe.depth
        self.in_flight: deque[Flight] = deque()
        self.threads_before = threads_before

    @property
    def ready(self) -> bool:
        return self.pipe.ready

    def retry(self) -> None:
        self.pipe.retry()

    def check(self) -> None:
        self.pipe.check()

    def submit(self, scheduled: list[ScheduledSeq], started: float, failed: list[SequenceOutput]) -> None:
        """Run the step's first stage here and send it on. Its time runs from its send: the stages'
        part of it, which is what `started` would add scheduling to."""
        step = self.pipe.runner.prepare(scheduled)
        step.argmax_only = all(argmax_only(item.seq) for item in scheduled if item.samples)
        try:
            self.pipe.submit(step)
        except StageError as e:
            self._run_alone(scheduled, e, failed)
            return
        self.in_flight.append(Flight(scheduled, time.perf_counter()))

    def result(self, failed: list[SequenceOutput]) -> Flight | None:
        if not self.in_flight:
            return None
        flight = self.in_flight.popleft()
        try:
            flight.logits = self.pipe.result()
        except StageError as e:
            self._run_alone(flight.scheduled, e, failed)
            return None
        return flight

    def _run_alone(self, scheduled: list[ScheduledSeq], error: Exception, failed: list[SequenceOutput]) -> None:
        """A step that raised: each of its sequences goes again on its own (writing its KV again, to
        the same places); one that fails alone is failed."""
        live = [item for item in scheduled if not item.seq.finished]
        if len(scheduled) == 1:
            for item in live:
                self.fail(item.seq, error, failed)
            return
        log.error("a pipelined step of %d sequences failed (%s); running them one by one", len(scheduled), error)
        for item in live:
            self.submit([item], 0.0, failed)

    def restart(self) -> None:
        """After a StageFailure: what was in flight is lost; the stages start again."""
        self.in_flight.clear()
        self.pipe.restart()

    def close(self) -> None:
        self.pipe.close()
        torch.set_num_threads(self.threads_before)
