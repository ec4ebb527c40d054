"""How many batch sequences a step decodes while interactive requests come.

An interactive request that arrives during a step waits for it to end before its prompt is read
(the engine steps on the server's loop), half a step on average. Batch work sits out every step
that reads an interactive prompt (scheduler.py), but the step in flight when the request came is
whatever it was, and a step of every running batch sequence is several times a short one.

So while an interactive request has come within INTERACTIVE_RECENT_SECONDS, a step carrying batch
decoders takes at most BACKGROUND_STEP_GROWTH times a decode step's fixed cost, by what decode steps
have cost (seconds = fixed + per_row * rows, fitted over recent decode-only steps), and at least one
batch sequence decodes, so that batch work always moves. Counted against the fixed cost, the bound
holds on any model and machine: an interactive request then waits under one fixed cost for the step
in flight on average, where its own first step takes that and its prompt. With no interactive
request about, batch work decodes as many sequences as run: its throughput then costs no one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from wafer.engine.scheduler import ScheduledSeq

# An interactive request within this many seconds keeps batch steps short: traffic that has just
# come tends to come again (an agent's next turn, a user's next message).
INTERACTIVE_RECENT_SECONDS = 10.0
# How long, in decode steps' fixed costs, a step carrying batch decoders may take while interactive
# requests come: the interactive time to first token against batch throughput (bench/batch.py).
BACKGROUND_STEP_GROWTH = 1.5


@dataclass
class DecodeCost:
    """seconds = fixed + per_row * rows over decode-only steps, each older one weighing `decay` of
    the one after."""

    decay: float = 0.9
    # Weighted sums: 1, rows, rows^2, seconds, rows*seconds.
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def observe(self, rows: int, seconds: float) -> None:
        s = [v * self.decay for v in self._sums]
        x = float(rows)
        self._sums = [s[0] + 1, s[1] + x, s[2] + x * x, s[3] + seconds, s[4] + x * seconds]

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed, per_row) in seconds; None before any step. Where the steps seen all had about the
        same rows, per_row is 0 and fixed their mean."""
        n, sx, sxx, sy, sxy = self._sums
        if n <= 0:
            return None
        det = n * sxx - sx * sx
        if det > 1e-6 * n * sxx:
            per_row = (n * sxy - sx * sy) / det
            fixed = (sy - per_row * sx) / n
            if per_row > 0 and fixed >= 0:
                return fixed, per_row
        return sy / n, 0.0


class BackgroundPace:
    def __init__(self) -> None:
        self.cost = DecodeCost()
        self.last_interactive = -math.inf

    def interactive(self) -> None:
        """An interactive request came."""
        self.last_interactive = time.monotonic()

    def rows(self) -> int | None:
        """The most decoders a step that carries batch ones may have now (the scheduler lets at
        least one batch sequence decode whatever this says); None: no bound."""
        if time.monotonic() - self.last_interactive > INTERACTIVE_RECENT_SECONDS:
            return None
        fit = self.cost.coefficients()
        if fit is None:
            return None
        fixed, per_row = fit
        if per_row <= 0:  # not told apart yet: one row, whose steps then tell them apart
            return 1
        # (+1e-9: 4 rows of 1 ms fit 4 ms, where float division may give 3.999...)
        return max(1, int((BACKGROUND_STEP_GROWTH - 1) * fixed / per_row + 1e-9))

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """Learn from a step that read no prompt: its rows and how long it took."""
        if scheduled and all(item.count == 1 + len(item.draft) and item.start >= item.seq.num_prompt
                             for item in scheduled):
            self.cost.observe(sum(item.count for item in scheduled), seconds)
