"""The calling thread's OpenMP workers: found by their thread ids, set idle between the server's
steps (and given their policy back), and let go of by release_compute_threads; steps leave a core
to side work (requests prepared off the loop)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from wafer.engine.async_engine import AsyncEngine, run_engines
from wafer.engine.compute_threads import (
    SIDE_WORK,
    ComputeThreads,
    SideWork,
    can_leave_idle,
    release_compute_threads,
    worker_ids,
)
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams, SequenceOutput
from wafer.models.loader import load_model


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _libgomp() -> bool:
    try:
        return "/libgomp" in open("/proc/self/maps").read()
    except OSError:
        return False


needs_pool = pytest.mark.skipif(not _libgomp(), reason="needs PyTorch on libgomp (Linux)")
needs_idle = pytest.mark.skipif(not can_leave_idle(), reason="this process may not leave SCHED_IDLE")


@pytest.fixture(autouse=True)
def two_compute_threads():
    """A pool of workers to look at, whatever share of the cores this test process was given (one
    under two pytest workers): two threads is what a 2-core machine runs, and any machine can."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


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
        workers.busy()
        assert {os.sched_getscheduler(t) for t in workers.ids} == {os.SCHED_OTHER}
        workers.idle()
    finally:
        workers.close()
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


def test_steps_leave_a_core_to_requests_prepared_beside_them(tiny_dir):
    """While side work runs in the process (a large request prepared off the loop), run_engines
    steps on one compute thread fewer, so that no parallel region waits for a thread the preparation
    preempted; once it is done, on all of them again."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what a 2-core machine runs; any machine can
    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=4, max_model_len=128)))
    seen: list[tuple[int, int]] = []
    step = engine.engine.step

    def counting_step() -> list[SequenceOutput]:
        seen.append((SIDE_WORK.active, torch.get_num_threads()))
        return step()

    engine.engine.step = counting_step  # type: ignore[method-assign]

    async def finish(req) -> None:  # type: ignore[no-untyped-def]
        while not (await asyncio.wait_for(req.queue.get(), 60)).finished:
            pass

    async def main() -> None:
        stepping = asyncio.create_task(run_engines([engine]))
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        try:
            with SIDE_WORK.running():
                await finish(engine.submit([1, 5, 9], params))
            await finish(engine.submit([1, 7, 11], params))
        finally:
            stepping.cancel()
            await asyncio.gather(stepping, return_exceptions=True)

    try:
        asyncio.run(main())
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert [t for active, t in seen if active] == [1, 1, 1]
    assert [t for active, t in seen if not active] == [2, 2, 2]
    assert after == 2  # given back when the stepping ends


def test_side_work_starts_once_a_step_that_uses_its_core_ends():
    side = SideWork()
    assert side.step_begins(2) == 2  # nothing beside it: every thread
    started = threading.Event()

    def job() -> None:
        with side.running(wait=30):
            started.set()
            time.sleep(0.2)

    t = threading.Thread(target=job)
    t.start()
    assert not started.wait(0.3)  # the step in flight computes on the core the job is to take
    side.step_ends()
    assert started.wait(10)
    assert side.step_begins(2) == 1 and side.active == 1  # the job runs: one thread fewer
    side.step_ends()
    t.join()
    assert side.active == 0 and side.step_begins(2) == 2
    side.step_ends()
    assert side.step_begins(1) == 1  # never fewer than one


def test_side_work_beside_a_step_that_left_it_a_core_starts_at_once():
    side = SideWork()
    side.step_begins(1)  # one thread: the job's core is free
    with side.running(wait=30):
        assert side.active == 1
    side.step_ends()


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two CPUs or more")


@needs_pool
@needs_two_cpus
def test_workers_are_bound_to_cores_of_their_own_and_the_stepping_thread_to_another_while_it_steps():
    mine = os.sched_getaffinity(0)
    n = torch.get_num_threads()
    workers = ComputeThreads(n)
    try:
        assert workers.cpu in mine
        placed = [os.sched_getaffinity(t) for t in worker_ids(n)]
        assert all(len(p) == 1 for p in placed)
        assert len(set().union(*placed) | {workers.cpu}) == n  # no two threads of the step on one CPU
        workers.busy()
        assert os.sched_getaffinity(0) == {workers.cpu}
        torch.randn(4096, 1024).exp()  # computes so placed
        workers.idle()
        assert os.sched_getaffinity(0) == mine  # between steps: anywhere (what it starts inherits this)
    finally:
        workers.close()
    assert os.sched_getaffinity(0) == mine
    assert all(os.sched_getaffinity(t) == mine for t in worker_ids(n))


@needs_pool
def test_nothing_is_bound_when_asked_not_to_or_with_one_thread():
    mine = os.sched_getaffinity(0)
    for workers in (ComputeThreads(torch.get_num_threads(), bind=False), ComputeThreads(1)):
        workers.busy()
        assert workers.cpu is None and os.sched_getaffinity(0) == mine
        workers.close()


@needs_pool
@needs_two_cpus
def test_run_engines_steps_on_its_core_and_side_work_runs_on_the_others(tiny_dir, monkeypatch):
    mine = os.sched_getaffinity(0)
    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=2, max_model_len=128)))
    during: list[set[int]] = []
    step = engine.engine.step

    def placed_step() -> list[SequenceOutput]:
        during.append(os.sched_getaffinity(0))
        return step()

    engine.engine.step = placed_step  # type: ignore[method-assign]
    beside: list[set[int]] = []

    def side_job() -> None:
        with SIDE_WORK.running():
            beside.append(os.sched_getaffinity(0))
        beside.append(os.sched_getaffinity(0))

    async def main() -> set[int]:
        task = asyncio.ensure_future(run_engines([engine]))
        req = engine.submit([1, 5, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while not (await req.queue.get()).finished:
            pass
        between = os.sched_getaffinity(0)
        await asyncio.to_thread(side_job)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return between

    between = asyncio.run(main())
    assert during and len({frozenset(p) for p in during}) == 1 and len(during[0]) == 1
    (cpu,) = during[0]
    assert between == mine
    assert beside == [mine - {cpu}, mine]  # kept off the stepping core while it works, then as it was
    assert os.sched_getaffinity(0) == mine and SIDE_WORK.stepping_cpu is None

    monkeypatch.setenv("WAFER_BIND_THREADS", "0")
    during.clear()

    async def unbound() -> None:
        task = asyncio.ensure_future(run_engines([engine]))
        req = engine.submit([1, 5, 9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while not (await req.queue.get()).finished:
            pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(unbound())
    assert during and all(p == mine for p in during)
