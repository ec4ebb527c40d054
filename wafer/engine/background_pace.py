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

from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.step_cost import StepCost

# An interactive request within this many seconds keeps batch steps short: traffic that has just
# come tends to come again (an agent's next turn, a user's next message).
INTERACTIVE_RECENT_SECONDS = 10.0
# How long, in decode steps' fixed costs, a step carrying batch decoders may take while interactive
# requests come: the interactive time to first token against batch throughput (bench/batch.py).
BACKGROUND_STEP_GROWTH = 1.5


class BackgroundPace:
    def __init__(self) -> None:
        # seconds = fixed * 1 + per_row * rows: step_cost.py's fit, its "tokens" one a step and its
        # "positions" the step's rows; each older step weighing 0.9 of the one after.
        self.cost = StepCost(decay=0.9)
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
            self.cost.observe(1, sum(item.count for item in scheduled), seconds)
