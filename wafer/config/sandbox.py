"""The limits of model-written programs (wafer/agents/sandbox.py runs them): one program's, and the
server's over all of them. wafer.toml's [sandbox] table sets any of their fields, and `wafer serve`'s
flags (SANDBOX_FLAGS) those operators change most, over it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProgramLimits:
    """What one program may use."""

    cpu_seconds: float = 10.0
    wall_seconds: float = 30.0  # total running time of one program, excluding time parked waiting for tool results
    # Its memory cgroup's limit: every page its processes use (anonymous, memfd, tmpfs, page cache);
    # each process's address space is bounded by it as well (RLIMIT_AS), for a MemoryError rather
    # than a kill where an allocation is what goes over.
    memory_bytes: int = 512 * 2**20
    processes: int = 32
    file_bytes: int = 16 * 2**20
    output_bytes: int = 64 * 1024  # text(...) output + stderr kept
    tmp_bytes: int = 32 * 2**20  # size of the private /tmp (its pages count in memory_bytes too)


@dataclass
class ProgramPoolSettings:
    """The server's bounds over all programs. The host memory programs can hold is at most
    max_running * memory_bytes + parked_memory_bytes."""

    max_running: int = 4  # programs running at once; one more gets a 429 (Retry-After)
    max_parked: int = 64  # programs waiting for tool outputs; one more ends with an error
    park_seconds: float = 600.0  # how long a parked program waits for its outputs
    # Memory the parked programs hold together: a parked program keeps what it has (its cgroup's
    # limit is lowered to it) and one that would take the total over this ends with an error.
    parked_memory_bytes: int = 2 * 2**30


# The least memory_bytes a server takes: under it the interpreter starts, but importing the standard
# library's compiled modules (json, statistics: _random's shared object) fails to map them into an
# address space that small (measured: 24 MiB fails, 28 MiB runs on CPython 3.11).
MIN_MEMORY_BYTES = 32 * 2**20

# Settings that may be 0: no program parks (one that calls a client's tool ends with an error).
MAY_BE_ZERO = ("max_parked", "parked_memory_bytes")

# `wafer serve`'s flags, by the field each sets.
SANDBOX_FLAGS = {
    "memory_bytes": "--program-memory",
    "cpu_seconds": "--program-cpu-seconds",
    "wall_seconds": "--program-wall-seconds",
    "max_running": "--max-running-programs",
    "max_parked": "--max-parked-programs",
    "parked_memory_bytes": "--parked-programs-memory",
}
