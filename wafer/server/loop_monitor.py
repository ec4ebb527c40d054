"""How long the event loop that writes every stream was held at a time.

The engine steps and every handler share one loop, so work done for one request on it delays the
tokens of all the others. A timer that should fire every `interval` seconds measures by how much it
was late: the longest such stall, and a histogram of them, go to /metrics, where the fuzz test and
bench/fuzz.py read them.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Gauge, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopMonitor:
    def __init__(self, registry: CollectorRegistry, interval: float = 0.05) -> None:
        self.interval = interval
        self.max_stall = 0.0
        self._task: asyncio.Task | None = None
        self.stalls = Histogram("wafer:event_loop_stall_seconds",
                                "How late the event loop ran a timer due every 50 ms (time it was held by "
                                "an engine step or a handler).", buckets=_BUCKETS, registry=registry)
        Gauge("wafer:event_loop_max_stall_seconds", "The longest the event loop was held since the server "
              "started.", registry=registry).set_function(lambda: self.max_stall)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            due = time.perf_counter() + self.interval
            await asyncio.sleep(self.interval)
            late = max(0.0, time.perf_counter() - due)
            self.stalls.observe(late)
            self.max_stall = max(self.max_stall, late)
