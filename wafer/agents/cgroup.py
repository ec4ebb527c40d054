"""Each program's own memory cgroup: the kernel charges it every page the program's processes use,
anonymous memory, memfd and tmpfs pages, page cache and kernel memory alike, so its limit bounds what a
program can take from the host where RLIMIT_AS (address space only) does not.

cgroup v2 where its memory controller is enabled for the server's cgroup's children; else the v1
memory hierarchy where the kernel mounts one (hybrid hosts, this project's CI); else none, and
programs are refused (check() says why): never run with the weaker limit alone."""
from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "wafer-program-"
_serial = itertools.count()


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 2 or 1
    parent: Path  # the server's own cgroup, under which each program's is made

    @property
    def files(self) -> dict[str, str]:
        """The controller's files by role: v1 and v2 name them differently."""
        if self.version == 2:
            return {"limit": "memory.max", "swap": "memory.swap.max", "usage": "memory.current",
                    "peak": "memory.peak", "events": "memory.events"}
        return {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes",
                "usage": "memory.usage_in_bytes", "peak": "memory.max_usage_in_bytes", "events": "memory.oom_control"}


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (controller None) or in v1's `controller` one."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (controller is None and hid == "0") or (controller is not None and controller in controllers.split(",")):
            return path
    return None


def _mounts(fstype: str) -> list[tuple[str, set[str]]]:
    """Mount points of `fstype` with their options."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, options, *_ = line.split()
        if kind == fstype:
            found.append((where, set(options.split(","))))
    return found


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


@functools.lru_cache(maxsize=1)
def find() -> Hierarchy | str:
    """The hierarchy programs' cgroups go in, or a sentence saying why there is none (cached)."""
    reasons = []
    own2 = _own_path(None)
    for where, _ in _mounts("cgroup2"):
        if own2 is None:
            break
        parent = Path(where + own2)
        controllers = (parent / "cgroup.controllers").read_text().split() if (parent / "cgroup.controllers").exists() else []
        if "memory" not in controllers:
            reasons.append(f"cgroup v2 at {where} has no memory controller for {own2}")
            continue
        subtree = parent / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            try:  # possible only where the server's cgroup holds no process (or is the root)
                subtree.write_text("+memory")
            except OSError as e:
                reasons.append(f"cgroup v2's memory controller is not delegated to {parent} ({e.strerror}): "
                               "run the server in a cgroup whose subtree_control has memory (systemd: Delegate=yes)")
                continue
        if _writable_dir(parent):
            sweep(parent)
            return Hierarchy(2, parent)
        reasons.append(f"cgroup v2 at {parent} is not writable by this user")
    own1 = _own_path("memory")
    for where, options in _mounts("cgroup"):
        if "memory" in options and own1 is not None:
            parent = Path(where + own1)
            if _writable_dir(parent):
                sweep(parent)
                return Hierarchy(1, parent)
            reasons.append(f"the cgroup v1 memory hierarchy at {parent} is not writable by this user")
    return "; ".join(reasons) or "no memory cgroup controller is mounted"


def sweep(parent: Path) -> None:
    """Removes the empty cgroups that servers which died left behind (named for their pid)."""
    for d in parent.glob(PREFIX + "*"):
        pid = d.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()
            except OSError:
                pass


def check() -> str | None:
    """None where programs get memory cgroups, else why not."""
    found = find()
    return found if isinstance(found, str) else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


class ProgramCgroup:
    """One program's memory cgroup; its processes join it before bubblewrap starts (procs_file)."""

    def __init__(self, hierarchy: Hierarchy, limit_bytes: int) -> None:
        self.hierarchy = hierarchy
        self.path = hierarchy.parent / f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.path.mkdir()
        self.limit_bytes = limit_bytes
        try:
            self.set_limit(limit_bytes)
            swap = self.path / hierarchy.files["swap"]
            if swap.exists():  # no swap either: swapped-out pages would escape the limit
                swap.write_text("0" if hierarchy.version == 2 else str(limit_bytes))
        except OSError:
            self.remove()
            raise

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def set_limit(self, limit_bytes: int) -> None:
        """v1 refuses a memory limit above its memory+swap limit: raising one goes swap first."""
        files = self.hierarchy.files
        if self.hierarchy.version == 1 and (self.path / files["swap"]).exists():
            swap = self.path / files["swap"]
            if limit_bytes > (_read_int(swap) or 0):
                swap.write_text(str(limit_bytes))
                (self.path / files["limit"]).write_text(str(limit_bytes))
            else:
                (self.path / files["limit"]).write_text(str(limit_bytes))
                swap.write_text(str(limit_bytes))
        else:
            (self.path / files["limit"]).write_text(str(limit_bytes))

    def usage(self) -> int:
        return _read_int(self.path / self.hierarchy.files["usage"]) or 0

    def peak(self) -> int:
        """Most bytes charged at once (v2 kernels before 5.19 have no memory.peak: usage then)."""
        return _read_int(self.path / self.hierarchy.files["peak"]) or self.usage()

    def oom_kills(self) -> int:
        """Processes the kernel killed here for the limit."""
        try:
            for line in (self.path / self.hierarchy.files["events"]).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self.procs_file).read_text().split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL to every process in the cgroup (what escaped the sandbox's process group too)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, timeout: float = 2.0) -> bool:
        """Kills what is left and removes the cgroup; False if it is still busy after timeout (the
        kernel ends a PID namespace's processes asynchronously)."""
        end = time.monotonic() + timeout
        while True:
            self.kill()
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() > end:
                    return False
                time.sleep(0.01)
