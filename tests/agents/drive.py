"""Runs a program to its end for the tests, answering its tool calls with a function of each call."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from wafer.agents.program import Program, ProgramResult, ToolCall, ToolSpec
from wafer.agents.sandbox import Limits

# What a program finds among its descriptors: each open one's link and, for a socket, its family;
# then it tries to accept on every socket, and to read and write every one above stderr that is not
# its event loop's own.
PROBE_FDS = """
import os, socket
report = []
for fd in range(1024):
    try:
        os.fstat(fd)
    except OSError:
        continue
    link = os.readlink(f'/proc/self/fd/{fd}')
    family = None
    if link.startswith('socket:'):
        s = socket.socket(fileno=os.dup(fd))
        family = s.family.name
        s.setblocking(False)
        try:
            conn, _ = s.accept()
            conn.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\npwned')
            report.append(f'ACCEPTED {fd}')
        except OSError:
            pass
        s.close()
    report.append(f'FD {fd} {link} {family}')
    if fd > 2 and link != 'anon_inode:[eventpoll]' and family != 'AF_UNIX':  # not its event loop's own
        for what, attempt in (('READ', lambda: os.pread(fd, 4096, 0)), ('WROTE', lambda: os.write(fd, b'pwned'))):
            try:
                report.append(f'{what} {fd} {attempt()!r}')
            except OSError:
                pass
text('\\n'.join(report))
"""

SMALL = Limits(cpu_seconds=2, wall_seconds=5, memory_bytes=256 * 2**20, processes=16, file_bytes=4 * 2**20,
               output_bytes=64 * 1024, tmp_bytes=8 * 2**20)


def drive(code: str, tools: Sequence[ToolSpec] = (), limits: Limits | None = SMALL,
          answer: Callable[[ToolCall], str] = lambda c: "ok",
          loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
          ) -> tuple[ProgramResult, list[list[ToolCall]]]:
    """The program's result and its pauses (each the list of calls advance() returned at once), on
    asyncio's own event loop or on `loop_factory`'s (uvloop's, as the server runs on)."""

    async def run() -> tuple[ProgramResult, list[list[ToolCall]]]:
        program = await Program.start(code, list(tools), limits)
        pauses: list[list[ToolCall]] = []
        try:
            while True:
                r = await program.advance()
                if isinstance(r, ProgramResult):
                    return r, pauses
                pauses.append(r)
                await program.resume({c.call_id: answer(c) for c in r})
        finally:
            await program.kill()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run())


def children(pid: int) -> set[int]:
    """Every live descendant of pid, found through /proc."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int], timeout: float = 3.0) -> set[int]:
    """The pids still alive after timeout (the kernel tears a PID namespace down asynchronously)."""
    end = time.monotonic() + timeout
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < end:
        time.sleep(0.02)
    return left


def only_its_pipes(report: str) -> list[tuple[str, str]]:
    """The program's three standard descriptors are pipes; any other it has is its event loop's own
    (an epoll and a socketpair of AF_UNIX sockets), none of the host's."""
    fds = [line.split() for line in report.splitlines() if line.startswith("FD ")]
    assert [(fd, link.split(":")[0]) for _, fd, link, _ in fds[:3]] == [("0", "pipe"), ("1", "pipe"), ("2", "pipe")], report
    others = [(link, family) for _, fd, link, family in fds[3:]]
    assert all(link == "anon_inode:[eventpoll]" or family == "AF_UNIX" for link, family in others), report
    return others
