"""What a stage needs to know of its part, and how a stage's failure is told."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class StageError(RuntimeError):
    """A step raised on a stage: that step's sequences fail (or are run again one by one)."""


class StageFailure(RuntimeError):
    """A stage is gone or does not answer: everything in flight is lost."""


@dataclass
class StageSpec:
    """What a stage process needs to build its part: all ranks read it from the store."""

    model: str  # the model's path, the same on every machine
    compute: str
    ranges: list[tuple[int, int]]  # [start, end) of the layers of each rank
    kv_dtype: torch.dtype
    num_slots: int
    max_len: int
    num_blocks: int
    threads: int  # compute threads of each stage process (0: torch's default)
    max_step: int  # the most tokens a sequence computes in a step
    window_pool: int  # blocks of the windowed layers' pools (0: every layer keeps every token)
    step_capacity: int = 1 << 22  # bytes of the receive buffers for steps; a larger step goes on its own
    logits_capacity: int = 1 << 22  # and for the logits that come back to rank 0
