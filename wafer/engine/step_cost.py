"""What a step's prompt work costs, learned from the steps themselves, and how much prompt fits a budget.

A token's cost grows with the context it attends to: on SmolLM2 (q4, 2 threads, a 2-core EPYC) a
chunk of 32 prompt tokens took 19 ms at position 0, 46 ms at 1000 and 132 ms at 4000. A cap counted
in tokens, learned while prompts were short, let a chunk of a long prompt take several times the
time allowed, and every decoder waited that long. So a step's cost is modelled as

    core-seconds = a * tokens + b * positions      (positions: the sum of its tokens' positions)

fitted by least squares over the recent steps (each older one weighing 0.8 of the one after), and a
chunk is sized so that its predicted cost stays within the step's budget. The step's fixed cost
falls into `a`, more so in a short step, so that a whole step, not its prompt work alone, settles at
the time allowed. Counted in core-seconds: on fewer compute threads (the server leaves cores to
requests it prepares) a step takes a smaller chunk, not the same one for longer. A token does not
cost the same core-seconds on one thread as on two, so each thread count has a fit of its own
(`StepCosts`): under bench/fuzz.py, where steps run on one thread or two as requests are prepared,
one fit for both had one-thread prompt steps take 0.91 of their prediction and two-thread ones 1.03
at the median, 1.41 at the 90th percentile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def positions_of(start: int, n: int) -> int:
    """The sum of the positions of n tokens from `start`."""
    return n * start + n * (n - 1) // 2


@dataclass
class StepCost:
    decay: float = 0.8
    # Weighted sums over the steps seen: tokens^2, tokens*positions, positions^2, tokens*y, positions*y.
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def observe(self, tokens: int, positions: int, core_seconds: float) -> None:
        s = [v * self.decay for v in self._sums]
        t, p, y = float(tokens), float(positions), core_seconds
        self._sums = [s[0] + t * t, s[1] + t * p, s[2] + p * p, s[3] + t * y, s[4] + p * y]

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b): core-seconds per token and per token and position; None before any step. Where the
        steps seen cannot tell the two apart (all at about the same position), b is 0 and a their mean."""
        tt, tp, pp, ty, py = self._sums
        if tt <= 0:
            return None
        det = tt * pp - tp * tp
        if pp > 0 and det > 1e-6 * tt * pp:
            a, b = (ty * pp - tp * py) / det, (tt * py - tp * ty) / det
            if a > 0 and b >= 0:
                return a, b
        return ty / tt, 0.0


@dataclass
class StepCosts:
    """A StepCost for each number of compute threads that steps ran on."""

    by_threads: dict[int, StepCost] = field(default_factory=dict)

    def observe(self, threads: int, tokens: int, positions: int, core_seconds: float) -> None:
        self.by_threads.setdefault(threads, StepCost()).observe(tokens, positions, core_seconds)

    def coefficients(self, threads: int) -> tuple[float, float] | None:
        """The fit of steps on `threads` threads; before the first of them, that of the nearest
        thread count seen (core-seconds carry over roughly); None before any step."""
        for t in sorted(self.by_threads, key=lambda t: (t != threads, abs(t - threads))):
            if (fit := self.by_threads[t].coefficients()) is not None:
                return fit
        return None


def tokens_within(cost: float, start: int, per_position: float) -> int:
    """The most tokens from `start` whose cost, counted in tokens at position 0 (a token at position p
    costs 1 + p * per_position of them), is at most `cost`."""
    if cost <= 0:
        return 0
    if per_position <= 0:
        return int(cost)
    # n (1 + k (start + (n - 1) / 2)) <= cost, solved for n
    half = per_position / 2
    lin = 1 + per_position * start - half
    n = max(0, int((-lin + math.sqrt(lin * lin + 4 * half * cost)) / (2 * half)))
    while n > 0 and n + per_position * positions_of(start, n) > cost:  # float rounding, either way
        n -= 1
    while n + 1 + per_position * positions_of(start, n + 1) <= cost:
        n += 1
    return n
