"""Drive the load: a closed loop of N concurrent clients and/or open-loop arrivals at a rate."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from rich.progress import Progress

from wafer.benchmark.client import RequestRecord, send
from wafer.benchmark.workload import Prompt

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The client's loop: uvloop's where it is installed, so that less of the machine's CPU goes to
    measuring, which matters when the server under test shares it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_async(main: Coroutine[Any, Any, T]) -> T:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    concurrency: int | None = None  # None: unbounded
    request_rate: float = float("inf")  # requests/s; inf sends as fast as concurrency allows
    burstiness: float = 1.0  # gamma shape: 1 = Poisson
    duration: float | None = None  # soak: keep sending until then (prompts cycle)
    ignore_eos: bool = False
    timeout: float = 600.0
    seed: int = 0
    # /v1/responses only: how the server spends compute on each request (direct, ultra or max)
    mode: str = "direct"
    subagents: int = 4
    effort: str = "high"


def mode_body(cfg: LoadConfig, output_len: int) -> dict:
    """What a /v1/responses request adds for its mode; Ultra's agents each get the output length."""
    if cfg.mode == "ultra":
        return {"multi_agent": {"enabled": True, "max_concurrent_subagents": cfg.subagents,
                                "max_output_tokens_per_agent": output_len}}
    if cfg.mode == "max":
        return {"reasoning": {"effort": cfg.effort}}
    return {}


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request starts: gamma(shape=b, scale=1/(rate*b)); zero for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_load(cfg: LoadConfig, prompts: list[Prompt], progress: Progress | None = None,
                   label: str = "") -> tuple[list[RequestRecord], float]:
    """Send the prompts; returns every record and the wall-clock duration."""
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    connector = aiohttp.TCPConnector(limit=max(cfg.concurrency or 256, 1) + 4)
    records: list[RequestRecord] = []
    task = progress.add_task(label, total=None if cfg.duration else len(prompts)) if progress else None
    async with aiohttp.ClientSession(connector=connector) as client:

        async def one(p: Prompt) -> None:
            if sem is not None:
                async with sem:
                    rec = await send(client, cfg.base_url, cfg.endpoint, cfg.model, p, cfg.api_key, cfg.ignore_eos,
                                     cfg.timeout, mode_body(cfg, p.output_len))
            else:
                rec = await send(client, cfg.base_url, cfg.endpoint, cfg.model, p, cfg.api_key, cfg.ignore_eos,
                                 cfg.timeout, mode_body(cfg, p.output_len))
            records.append(rec)
            if progress is not None and task is not None:
                progress.advance(task)

        start = time.perf_counter()
        tasks = []
        gaps = arrival_gaps(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
        i = 0
        while True:
            if cfg.duration is None and i >= len(prompts):
                break
            if cfg.duration is not None and time.perf_counter() - start >= cfg.duration:
                break
            if sem is not None and cfg.request_rate == float("inf"):
                # Closed loop: wait for a free client before creating the next request.
                await sem.acquire()
                sem.release()
            tasks.append(asyncio.ensure_future(one(prompts[i % len(prompts)])))
            gap = gaps[i % len(gaps)]
            i += 1
            await asyncio.sleep(gap if gap > 0 else 0)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return records, duration
