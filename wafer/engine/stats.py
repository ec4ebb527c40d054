"""What an engine counts as it steps, and what it says of itself at one moment."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wafer.engine.speculative.stats import SpecStats

if TYPE_CHECKING:
    from wafer.engine.block_manager import BlockManager
    from wafer.engine.pipeline.executor import PipelineExecutor
    from wafer.engine.scheduler import Scheduler


@dataclass
class EngineStats:
    steps: int = 0
    batched_steps: int = 0  # steps that advanced more than one sequence
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_batch_size: int = 0  # sequences advanced by the most recent step
    last_forward_seconds: float = 0.0  # of the most recent step: scheduling and the forward pass, before its tokens are picked
    last_mask_seconds: float = 0.0  # of the most recent step: its grammars' masks, part of picking the tokens
    last_mask_cpu_seconds: float = 0.0  # the same work's CPU time (of the stepping thread: load elsewhere aside)
    max_batch_size: int = 0  # the most sequences one step has advanced
    spec: SpecStats = field(default_factory=SpecStats)

    def record_step(self, batch: int, forward_seconds: float) -> None:
        """A step of `batch` sequences came back from its forward pass."""
        self.steps += 1
        self.last_batch_size = batch
        self.last_forward_seconds = forward_seconds
        self.max_batch_size = max(self.max_batch_size, batch)
        if batch > 1:
            self.batched_steps += 1


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine says of itself at one moment: all that the server's metrics and health read."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV blocks live sequences hold
    kv_peak_usage: float
    kv_capacity_bytes: int
    kv_written_bytes: int  # of the blocks written at least once (BlockManager.written_bytes)
    prefix_hit_rate: float
    last_batch_size: int
    num_preemptions: int
    spec: SpecStats
    fault: str | None = None  # why the engine cannot serve now (a pipeline stage is down), if it cannot
    pipeline: dict | None = None  # stages, restarts and transfer time, with pipeline stages

    @classmethod
    def of(cls, scheduler: Scheduler, blocks: BlockManager, stats: EngineStats,
           pipe: PipelineExecutor | None) -> EngineSnapshot:
        info = None
        if pipe is not None:
            info = {"stages": pipe.world, "layers": pipe.spec.ranges, "restarts": pipe.restarts,
                    "transfer_seconds": round(pipe.transfer_seconds, 3), "stage_pids": pipe.stage_pids()}
        return cls(len(scheduler.running), len(scheduler.waiting), blocks.usage, blocks.peak_usage,
                   blocks.capacity_bytes, blocks.written_bytes, blocks.prefix_hit_rate, stats.last_batch_size,
                   scheduler.num_preemptions, copy.deepcopy(stats.spec),
                   pipe.fault if pipe is not None and not pipe.ready else None, info)
