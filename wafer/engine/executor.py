"""Where a step's forward pass runs, behind one interface: in this process (LocalExecutor, on a
ModelRunner: the fused CPU step, CUDA graphs or the Python model), or through pipeline stages
(pipeline.steps.PipelineSteps), which keep up to one step per stage in flight.

The engine sends steps while the executor has room for them and then takes the oldest step's
logits. A failure that belongs to the step's sequences fails them through `fail`, one by one
where a batch fails as a whole; a broken executor (a stage gone) raises StageFailure.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from wafer.engine.model_runner import ModelRunner
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence, SequenceOutput

log = logging.getLogger("wafer.engine")

# Ends a sequence that failed in a step alone, adding its last output to the list.
Fail = Callable[[Sequence, Exception, list[SequenceOutput]], None]


@dataclass
class Flight:
    """A step sent to an executor: its sequences, when its timing started, and its logits once back."""

    scheduled: list[ScheduledSeq]
    started: float
    logits: torch.Tensor | None = None


class Executor(Protocol):
    depth: int  # steps in flight at once
    in_flight: deque[Flight]

    @property
    def ready(self) -> bool:
        """Whether steps can be sent now (pipeline stages may be starting again)."""
        ...

    def retry(self) -> None:
        """Called while not ready: start again what has failed to start."""
        ...

    def check(self) -> None:
        """Raise StageFailure where a part of the executor is gone."""
        ...

    def submit(self, scheduled: list[ScheduledSeq], started: float, failed: list[SequenceOutput]) -> None:
        """Send a step; `started`: when its scheduling began (the step's time runs from there)."""
        ...

    def result(self, failed: list[SequenceOutput]) -> Flight | None:
        """The oldest step with its logits, its failed sequences left out; None: nothing is in flight."""
        ...

    def restart(self) -> None:
        """After a StageFailure: drop what is in flight and start the broken part again."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """Steps run here, one at a time, on the model's runner."""

    depth = 1

    def __init__(self, runner: ModelRunner, fail: Fail) -> None:
        self.runner = runner
        self.fail = fail
        self.in_flight: deque[Flight] = deque()

    @property
    def ready(self) -> bool:
        return True

    def retry(self) -> None:
        pass

    def check(self) -> None:
        pass

    def submit(self, scheduled: list[ScheduledSeq], started: float, failed: list[SequenceOutput]) -> None:
        """The model's logits for the scheduled sequences. Should the batch fail, each sequence is
        run alone (writing its KV again, to the same places) and those that fail alone are failed."""
        kept, logits = self._forward(scheduled, failed)
        if kept:
            self.in_flight.append(Flight(kept, started, logits))

    def _forward(self, scheduled: list[ScheduledSeq], failed: list[SequenceOutput]
                 ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        try:
            return scheduled, self.runner.run(scheduled)
        except Exception as e:
            if len(scheduled) == 1:
                self.fail(scheduled[0].seq, e, failed)
                return [], torch.empty(0)
            log.exception("a batched step of %d sequences failed; running them one by one", len(scheduled))
        kept, parts = [], []
        for item in scheduled:
            try:
                parts.append(self.runner.run([item]))
                kept.append(item)
            except Exception as e:
                self.fail(item.seq, e, failed)
        return kept, (torch.cat(parts) if parts else torch.empty(0))

    def result(self, failed: list[SequenceOutput]) -> Flight | None:
        return self.in_flight.popleft() if self.in_flight else None

    def restart(self) -> None:
        self.in_flight.clear()

    def close(self) -> None:
        pass
