"""The OpenMP worker threads that compute a step beside the thread that steps the engine.

PyTorch's CPU parallelism (and wafer's kernels, through at::parallel_for) runs on libgomp: the
stepping thread leads a pool of workers, one per further compute thread, that spin for a few
milliseconds after each parallel region before they sleep. Within a step that is what makes its
~150 regions cheap. Between steps it keeps a core busy with nothing: on a machine whose cores the
step fills, the client a server's write wakes then lands on the stepping thread's core and preempts
it (the write's wake-up says the writer will sleep, and no core looks idle), and the step waits.

`ComputeThreads.idle()` makes the workers SCHED_IDLE between steps: a core that runs only such
threads counts as idle when the kernel places a woken task, and any other task preempts them at
once, so the client runs on the spinning worker's core while the server goes on. `busy()` gives
them back the normal policy before the next step. Leaving SCHED_IDLE needs CAP_SYS_NICE or an
RLIMIT_NICE that allows nice 0; where the process has neither, the workers are left as they are.

It also keeps the step's threads on cores of their own. Left to place them, the kernel put the
stepping thread and its worker on one core whenever the other was busy (a client, a request being
prepared): each then spun at every barrier for the other's time slice, and a 2-token step that
takes 5 ms took 100 to 340 ms (measured under bench/fuzz.py: both threads ran ~170 ms and waited
~170 ms on one run queue). So each worker is bound to a core, and the stepping thread to another
while a step computes (only then: threads and processes it starts between steps, a sandbox, a
pipeline stage, inherit the whole set), with side work kept off the stepping thread's core, as
vLLM's CPU backend binds its OpenMP threads. `WAFER_BIND_THREADS=0` leaves placement to the kernel.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path


def _libgomp() -> ctypes.CDLL | None:
    """PyTorch's own copy of libgomp, whatever its file is called (wheels may add a hash to the
    name); None where PyTorch uses another runtime or it is not loaded."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    path = next((p for p in (line.split()[-1] for line in maps) if Path(p).name.startswith("libgomp")), None)
    try:
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


def release_compute_threads() -> None:
    """Let go of the calling thread's OpenMP worker threads, so that another thread's compute runs at
    full speed.

    libgomp keeps a pool of workers for each thread that has run a parallel region, and while the
    process has more of them than CPUs, workers stop spinning between regions and sleep at once: a
    decode step (hundreds of short regions) on a second thread then took ten times as long. So the
    thread that steps an engine should be the only one to have computed, or the others call this.
    Their pool comes back if they compute again. A no-op where PyTorch uses another runtime."""
    gomp = _libgomp()
    try:
        if gomp is not None:
            gomp.omp_pause_resource_all(1)  # omp_pause_soft
    except AttributeError:
        pass


def worker_ids(threads: int) -> list[int]:
    """The thread ids of the calling thread's OpenMP workers for `threads` compute threads (the
    pool a parallel region of PyTorch's on this thread runs on), made if there are none yet."""
    gomp = _libgomp()
    if gomp is None or threads < 2:
        return []
    seen: set[int] = set()

    # A parallel region of our own, as PyTorch's at::parallel_for opens one: every thread of the
    # team (the caller and its workers) runs this once. ctypes lets go of the GIL for the call.
    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def record(_: int | None) -> None:
        seen.add(threading.get_native_id())

    try:
        gomp.GOMP_parallel(record, None, ctypes.c_uint(threads), ctypes.c_uint(0))
    except AttributeError:
        return []
    seen.discard(threading.get_native_id())
    return sorted(seen)


def _one_per_core(cpus: set[int]) -> list[int]:
    """The CPUs, one of each physical core first, then their SMT siblings: compute threads bound
    in this order share no core while there are cores enough."""
    first: list[int] = []
    siblings: list[int] = []
    seen: set[tuple[str, str]] = set()
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            core = ("", str(cpu))
        (siblings if core in seen else first).append(cpu)
        seen.add(core)
    return first + siblings


def binding_wanted() -> bool:
    return os.environ.get("WAFER_BIND_THREADS", "1").strip().lower() not in ("0", "false", "no", "off")


@cache
def can_leave_idle() -> bool:
    """Whether a thread of this process may go back from SCHED_IDLE to the normal policy (tried on
    a thread made for the purpose)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok: list[bool] = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            ok.append(False)

    t = threading.Thread(target=attempt, name="wafer-sched-probe")
    t.start()
    t.join()
    return ok == [True]


class ComputeThreads:
    """The calling thread's OpenMP workers, to be set idle between steps and busy for them, and the
    cores the step computes on. Made on the thread that steps the engines; leaves the policy alone
    where the workers cannot be found or could not be given it back, and binds nothing where the
    process has fewer CPUs than compute threads, one thread, or `bind` off."""

    def __init__(self, threads: int, bind: bool = True) -> None:
        workers = worker_ids(threads)
        self.ids = workers if can_leave_idle() else []
        self._idle = False
        self.cpu: int | None = None  # the stepping thread's core while it steps; None: not bound
        self._cpus: set[int] = set()
        self._workers: list[int] = []
        if bind and threads >= 2 and len(workers) == threads - 1 and hasattr(os, "sched_setaffinity"):
            self._cpus = os.sched_getaffinity(0)
            order = _one_per_core(self._cpus)
            if len(order) >= threads:
                try:
                    for tid, cpu in zip(workers, order[1:]):
                        os.sched_setaffinity(tid, {cpu})
                    self.cpu = order[0]
                    self._workers = workers
                except OSError:  # not ours to place (a seccomp or cgroup rule): the kernel places them
                    self.cpu = None

    def _set(self, policy: int) -> None:
        alive = []
        for tid in self.ids:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                alive.append(tid)
            except OSError:  # a worker gone (its pool was remade): no longer ours to manage
                pass
        self.ids = alive

    def idle(self) -> None:
        if self.ids and not self._idle:
            self._set(os.SCHED_IDLE)
            self._idle = True
        if self.cpu is not None:
            os.sched_setaffinity(0, self._cpus)

    def busy(self) -> None:
        if self.ids and self._idle:
            self._set(os.SCHED_OTHER)
            self._idle = False
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})

    def close(self) -> None:
        """The threads as they were: the normal policy, and every CPU of the process's."""
        self.busy()
        if self.cpu is not None:
            for tid in [0, *self._workers]:  # 0: this thread
                try:
                    os.sched_setaffinity(tid, self._cpus)
                except OSError:  # a worker gone
                    pass
            self.cpu = None


class SideWork:
    """Work that this process does in other threads while the engines step: requests prepared off
    the event loop (parsing large bodies, templates, tokenizing, compiling grammars).

    On a machine whose cores the step's compute threads fill, such a thread preempts one of them,
    and each of the step's hundreds of parallel regions then waits for the preempted thread: beside
    the fuzz run's preparations a 16-token prefill that takes about 15 ms took 200 to 600 ms, and
    held every stream that long. So while side work runs, a step leaves it a core (`step_begins`),
    and a job that arrives during a step that uses its core starts when that step ends (a step
    lasts about --prefill-step-ms; the job waits at most `wait` seconds). Where the stepping thread
    is bound to a core (ComputeThreads), jobs run on the others."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._full = 0  # the stepping thread's compute threads in all
        self._stepping = 0  # compute threads of the step in flight; 0: none
        self.stepping_cpu: int | None = None  # the core the stepping thread is bound to, if it is

    def _threads_for(self, full: int) -> int:
        return max(1, full - self._active)

    @contextmanager
    def running(self, wait: float = 0.5) -> Iterator[None]:
        with self._cond:
            self._active += 1
            self._cond.wait_for(lambda: self._stepping <= self._threads_for(self._full), wait)
        cpu = self.stepping_cpu
        mask = os.sched_getaffinity(0) if cpu is not None else set()
        others = mask - {cpu}
        if others:
            os.sched_setaffinity(0, others)
        try:
            yield
        finally:
            if others:
                os.sched_setaffinity(0, mask)
            with self._cond:
                self._active -= 1

    @property
    def active(self) -> int:
        return self._active

    def step_begins(self, full: int) -> int:
        """The compute threads for a step about to run, of `full`: one fewer per job running beside
        it, at least one."""
        with self._cond:
            self._full = full
            self._stepping = self._threads_for(full)
            return self._stepping

    def step_ends(self) -> None:
        with self._cond:
            self._stepping = 0
            self._cond.notify_all()


SIDE_WORK = SideWork()  # one per process, as its cores are
