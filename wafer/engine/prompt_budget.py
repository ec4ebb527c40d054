"""How much prompt work a step may take: the step's time budget turned into tokens at position 0,
by what a token has cost in earlier prompt steps (step_cost.py)."""

from __future__ import annotations

import torch

from wafer.engine.scheduler import MIN_CHUNK, ScheduledSeq
from wafer.engine.step_cost import StepCosts, positions_of


# A step of fewer prompt tokens teaches nothing of their cost: its fixed cost would swamp them.
LEARN_FROM = 8


class PromptBudget:
    def __init__(self, step_seconds: float | None) -> None:
        """`step_seconds`: the prompt work a step may take, in seconds (None: no limit)."""
        self.step_seconds = step_seconds
        self.costs = StepCosts()  # what a step's tokens cost, learned from its prompt steps

    def cap(self) -> tuple[int | None, float]:
        """The prompt work a step may take, in tokens at position 0, and what a position adds to a
        token's cost in those (the scheduler's prefill_cap and per_position); no cap before a prompt
        step has been timed."""
        fit = self.costs.coefficients(torch.get_num_threads())
        if self.step_seconds is None or fit is None:
            return None, 0.0
        a, b = fit
        return max(MIN_CHUNK, int(self.step_seconds * torch.get_num_threads() / a)), b / a

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """Learn the cost of a token from a step of some prompt work."""
        prompt = sum(max(0, min(item.count, item.seq.num_prompt - item.start)) for item in scheduled)
        if prompt >= LEARN_FROM:
            self.costs.observe(torch.get_num_threads(), sum(item.count for item in scheduled),
                               sum(positions_of(item.start, item.count) for item in scheduled),
                               seconds * torch.get_num_threads())
