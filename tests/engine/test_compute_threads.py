"""The calling thread's OpenMP workers: found by their thread ids, set idle between the server's
steps (and given their policy back), and let go of by release_compute_threads."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from wafer.engine.async_engine import AsyncEngine, run_engines
from wafer.engine.compute_threads import ComputeThreads, can_leave_idle, release_compute_threads, worker_ids
from wafer.engine.engine import EngineConfig, LLMEngine
from wafer.engine.sequence import SamplingParams
from wafer.models.loader import load_model


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _libgomp() -> bool:
    try:
        return "/libgomp" in open("/proc/self/maps").read()
    except OSError:
        return False


needs_pool = pytest.mark.skipif(not _libgomp() or torch.get_num_threads() < 2,
                                reason="needs PyTorch on libgomp (Linux) and two compute threads")
needs_idle = pytest.mark.skipif(not can_leave_idle(), reason="this process may not leave SCHED_IDLE")


@needs_pool
def test_release_compute_threads_lets_this_threads_openmp_workers_go():
    # The workers a parallel region leaves behind are threads of this process: they end on release,
    # and the next region brings them back.
    x = torch.randn(4096, 1024)
    x.exp()
    with_pool = len(_threads())
    release_compute_threads()
    deadline = time.monotonic() + 5
    while len(_threads()) >= with_pool and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_threads()) == with_pool - (torch.get_num_threads() - 1)
    x.exp()
    assert len(_threads()) == with_pool


@needs_pool
def test_worker_ids_are_the_threads_pytorchs_regions_run_on():
    n = torch.get_num_threads()
    release_compute_threads()
    before = _threads()
    torch.randn(4096, 1024).exp()  # PyTorch's region makes this thread's pool
    made = _threads() - before
    ids = worker_ids(n)
    assert len(ids) == n - 1 and set(ids) == made  # the same threads, none made anew, not the caller
    assert worker_ids(n) == ids


@needs_pool
@needs_idle
def test_idle_and_busy_set_the_workers_policy():
    workers = ComputeThreads(torch.get_num_threads())
    assert workers.ids
    try:
        workers.idle()
        assert {os.sched_getscheduler(t) for t in workers.ids} == {os.SCHED_IDLE}
        torch.randn(4096, 1024).exp()  # still computes
    finally:
        workers.busy()
    assert {os.sched_getscheduler(t) for t in workers.ids} == {os.SCHED_OTHER}


@needs_pool
@needs_idle
def test_run_engines_idles_its_workers_between_steps_and_restores_them(tiny_dir):
    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=2, max_model_len=128)))

    async def main() -> tuple[set[int], set[int], set[int]]:
        task = asyncio.ensure_future(run_engines([engine]))
        req = engine.submit([1, 5, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while not (await req.queue.get()).finished:
            pass
        ids = worker_ids(torch.get_num_threads())  # run_engines' own: this thread's pool
        between = {os.sched_getscheduler(t) for t in ids}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return set(ids), between, {os.sched_getscheduler(t) for t in ids}

    ids, between, after = asyncio.run(main())
    assert ids
    assert between == {os.SCHED_IDLE}
    assert after == {os.SCHED_OTHER}
