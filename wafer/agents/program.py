"""A model-written Python program run in the sandbox, driven from the server: it runs until it is
blocked on tool calls (advance() returns them), is resumed with their outputs, and ends with a
ProgramResult. Whatever the program does, advance() answers; it never raises."""
from __future__ import annotations

import asyncio
import json
import keyword
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import jsonschema

from wafer import untrusted_json
from wafer.agents.sandbox import Limits, SandboxProcess, SandboxUnavailable, check_sandbox, rlimits, spawn

if TYPE_CHECKING:
    from wafer.agents.ptc import ProgramPool

RUNNER_SOURCE = (Path(__file__).parent / "program_runner.py").read_text()
MAX_MESSAGE_BYTES = 1 << 20  # one protocol line from the runner: a tool call's arguments, an output chunk
MAX_CODE_BYTES = 256 * 1024
RESERVED_NAMES = frozenset({"text", "print", "asyncio", "json", "ToolError"})
EXIT_GRACE_S = 2.0
PARK_MARGIN_BYTES = 2 * 2**20  # room a parked program keeps above what it holds (the runner reads its reply)


@dataclass
class ToolSpec:
    name: str
    parameters: dict  # JSON Schema of the arguments (may be {} = anything)


@dataclass
class ToolCall:
    call_id: str  # unique, e.g. "call_" + hex
    name: str
    arguments: str  # JSON text of the arguments (already schema-checked)


@dataclass
class ProgramResult:
    status: Literal["completed", "incomplete"]
    result: str  # what the program gave to text(...) (and print), bounded
    error: str | None = None  # readable reason when incomplete


class _Stop(Exception):
    """Ends the program as incomplete with this reason."""


def _params(schema: dict) -> list[str]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return list(props) if isinstance(props, dict) else []


def _output_value(text: str) -> object:
    try:
        return untrusted_json.loads(text)
    except ValueError:
        return text


class Program:
    def __init__(self, process: SandboxProcess, to_runner: int, from_runner: asyncio.StreamReader,
                 transports: list[asyncio.ReadTransport], stderr: asyncio.StreamReader, tools: list[ToolSpec],
                 limits: Limits, pool: ProgramPool | None) -> None:
        self._process = process
        self._to_runner = to_runner
        self._from_runner = from_runner
        self._transports = transports
        self._tools = {t.name: t for t in tools}
        self._limits = limits
        self._pool = pool
        self.holds: Literal["running", "parked", "nothing"] = "running"  # what it counts for in the pool
        self.parked_bytes = 0  # the memory it holds while parked
        self._output: list[str] = []
        self._output_bytes = 0
        self._stderr = bytearray()
        self._stderr_task = asyncio.create_task(self._read_stderr(stderr))
        self._batch: dict[str, ToolCall] = {}  # call_id -> call, reported and awaiting outputs
        self._runner_ids: dict[str, str] = {}  # call_id -> the runner's id of that call
        self._ran_s = 0.0
        self._result: ProgramResult | None = None
        self._parked = False
        self._killed_for: str | None = None  # why the parent killed the program, when it did
        self._peak: int | None = None  # its cgroup's peak, read before the cgroup is removed

    @classmethod
    async def start(cls, code: str, tools: list[ToolSpec], limits: Limits | None = None,
                    pool: ProgramPool | None = None) -> Program:
        """Raises SandboxUnavailable where the sandbox cannot start, ValueError for a tool the program
        could not see under its name, ProgramsBusy (an APIError, 429) where `pool` runs as many
        programs as it may."""
        limits = limits or Limits()
        for t in tools:
            if not t.name.isidentifier() or keyword.iskeyword(t.name) or t.name in RESERVED_NAMES:
                raise ValueError(f"tool name {t.name!r} cannot be a Python function of the program")
        reason = await asyncio.to_thread(check_sandbox)
        if reason is not None:
            raise SandboxUnavailable(reason)
        if pool is not None:
            pool.admit()  # counts the program from here: starts that wait on the spawn below count too
        try:
            process, in_w, out_r, err_r = await spawn(["-c", RUNNER_SOURCE, json.dumps(rlimits(limits))], limits)
            loop = asyncio.get_running_loop()
            transports, readers = [], []
            for fd in (out_r, err_r):
                reader = asyncio.StreamReader(limit=MAX_MESSAGE_BYTES)
                transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r),
                                                            os.fdopen(fd, "rb", 0))
                transports.append(transport)
                readers.append(reader)
            program = cls(process, in_w, readers[0], transports, readers[1], tools, limits, pool)
            if pool is not None:
                pool.programs.add(program)  # counted as itself from now on
        finally:
            if pool is not None:
                pool.release()
        try:
            if len(code.encode()) > MAX_CODE_BYTES:
                raise _Stop(f"program over {MAX_CODE_BYTES} bytes")
            tool_list = [{"name": t.name, "params": _params(t.parameters)} for t in tools]
            await program._send({"t": "start", "code": code, "tools": tool_list}, time.monotonic() + limits.wall_seconds)
        except (_Stop, OSError) as e:
            await program._finish("incomplete", str(e) if isinstance(e, _Stop) else f"the sandbox went away: {e}")
        return program

    @property
    def finished(self) -> bool:
        return self._result is not None

    @property
    def pid(self) -> int | None:
        """The host pid of the sandbox's outermost process while it lives."""
        return None if self._result is not None and self._process.returncode is not None else self._process.pid

    async def advance(self) -> list[ToolCall] | ProgramResult:
        """Runs the program until it is blocked on tool calls (all of them, in one list) or ends."""
        if self._result is not None:
            return self._result
        if self._parked:
            return list(self._batch.values())
        began = time.monotonic()
        deadline = began + max(0.0, self._limits.wall_seconds - self._ran_s)
        try:
            calls = await self._run_until_blocked(deadline)
        except _Stop as e:
            return await self._finish("incomplete", str(e))
        except asyncio.CancelledError:
            await self.kill()
            raise
        finally:
            self._ran_s += time.monotonic() - began
        return calls

    async def resume(self, outputs: dict[str, str]) -> None:
        """Gives the program the outputs of every call advance() returned (call_id -> text); where
        its pool runs as many programs as it may, first waits for one to park or end."""
        if self._result is not None:
            return
        if not self._parked:
            raise RuntimeError("the program is not waiting for tool outputs")
        missing = sorted(set(self._batch) - set(outputs))
        unknown = sorted(set(outputs) - set(self._batch))
        if missing or unknown:
            raise ValueError(f"outputs must answer exactly the program's calls: missing {missing}, unknown {unknown}")
        if self._pool is not None:
            await self._pool.wait_to_run()
            if self._result is not None:  # freed while it waited (its response deleted, its time up)
                return
        results = {self._runner_ids.pop(cid): {"value": _output_value(outputs[cid])} for cid in self._batch}
        self._batch.clear()
        self._parked = False
        self.unpark()
        try:
            await self._send({"t": "results", "results": results}, time.monotonic() + self._limits.wall_seconds)
        except (_Stop, OSError):
            pass  # the next advance() reads the end and says why

    def hold_parked(self, refuse: bool = False) -> None:
        """From running to parked: the program keeps the memory it has (its cgroup's limit comes down
        to it), which counts in the pool's parked memory. With `refuse`, a program the pool has no
        room for is stopped (_Stop) instead."""
        if self.holds != "running":
            return
        group = self._process.cgroup
        held = min(self._limits.memory_bytes, group.usage() + PARK_MARGIN_BYTES)
        try:
            group.set_limit(held)
        except OSError:  # the kernel could not reclaim down to it: it holds its whole limit
            held = self._limits.memory_bytes
        if self._pool is not None and refuse:
            why = self._pool.parking_refused(held)
            if why is not None:
                raise _Stop(why)  # and it ends: the lowered limit does not matter
        self.holds, self.parked_bytes = "parked", held
        if self._pool is not None:
            self._pool.freed.set()

    def unpark(self) -> None:
        """From parked to running again: its whole memory limit back."""
        if self.holds != "parked":
            return
        try:
            self._process.cgroup.set_limit(self._limits.memory_bytes)
        except OSError:
            pass  # the cgroup is gone with the program: the next advance() says why it ended
        self.holds, self.parked_bytes = "running", 0

    @property
    def memory_peak(self) -> int:
        """The most memory the program's cgroup was charged at once (bytes)."""
        return self._peak if self._peak is not None else self._process.cgroup.peak()

    async def kill(self) -> None:
        """Ends the program and frees its processes; idempotent."""
        if self._result is None:
            self._result = ProgramResult("incomplete", self._text(), "killed")
        await self._reap()

    # --- inside ---------------------------------------------------------------------------------

    async def _run_until_blocked(self, deadline: float) -> list[ToolCall] | ProgramResult:
        while True:
            msg = await self._receive(deadline)
            if msg is None:
                return await self._ended_without_done()
            kind = msg.get("t") if isinstance(msg, dict) else None
            if kind == "out":
                self._add_output(str(msg.get("s", "")))
            elif kind == "calls":
                errors = self._take_calls(msg.get("calls"))
                if errors:
                    await self._send({"t": "results", "results": errors}, deadline)
                elif self._batch:
                    self.hold_parked(refuse=True)
                    self._parked = True
                    return list(self._batch.values())
                else:
                    raise _Stop("the program waits for tool calls it never made")
            elif kind == "done":
                error = msg.get("error")
                await self._wait_exit()
                if error is not None:
                    return await self._finish("incomplete", str(error)[-self._limits.output_bytes:])
                return await self._finish("completed", None)
            else:
                raise _Stop("the program broke its protocol")

    def _take_calls(self, calls: object) -> dict[str, dict]:
        """Checks each new call; the valid ones join the batch, the refused ones are errors to raise."""
        if not isinstance(calls, list):
            raise _Stop("the program broke its protocol")
        errors: dict[str, dict] = {}
        for c in calls:
            if not isinstance(c, dict) or not isinstance(c.get("id"), str):
                raise _Stop("the program broke its protocol")
            rid, name, args = c["id"], c.get("name"), c.get("args")
            if rid in self._runner_ids.values() or rid in errors:
                raise _Stop("the program broke its protocol")
            tool = self._tools.get(name) if isinstance(name, str) else None
            if tool is None:
                errors[rid] = {"error": f"no tool named {name!r}"}
                continue
            try:
                jsonschema.validate(args, tool.parameters or {})
            except jsonschema.ValidationError as e:
                errors[rid] = {"error": f"{name}: {e.message}"}
                continue
            except jsonschema.SchemaError as e:
                errors[rid] = {"error": f"{name}: the tool's schema is invalid: {e.message}"}
                continue
            call = ToolCall("call_" + secrets.token_hex(12), name, json.dumps(args))
            self._batch[call.call_id] = call
            self._runner_ids[call.call_id] = rid
        return errors

    async def _receive(self, deadline: float) -> object | None:
        try:
            line = await asyncio.wait_for(self._from_runner.readline(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise _Stop(f"timed out after {self._limits.wall_seconds:g} s") from None
        except (ValueError, asyncio.LimitOverrunError):
            raise _Stop(f"a message from the program was over {MAX_MESSAGE_BYTES} bytes") from None
        if not line:
            return None
        try:
            return untrusted_json.loads(line)
        except ValueError:
            # a line that is not JSON: most likely a raw write to descriptor 1 (a child process's output)
            raise _Stop("the program broke its protocol: its standard output carries the sandbox's messages, "
                        "so print through print() or text(), and capture a subprocess's output") from None

    async def _send(self, msg: dict, deadline: float) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            try:
                data = data[os.write(self._to_runner, data):]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _Stop(f"timed out after {self._limits.wall_seconds:g} s") from None
                await asyncio.sleep(0.005)  # the runner drains its pipe only between steps of the program

    def _add_output(self, s: str) -> None:
        self._output_bytes += len(s.encode())
        if self._output_bytes > self._limits.output_bytes:
            raise _Stop(f"output over {self._limits.output_bytes} bytes")
        self._output.append(s)

    def _text(self) -> str:
        return "".join(self._output)

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 14):
            room = self._limits.output_bytes - len(self._stderr)
            self._stderr += chunk[:max(0, room)]
            if len(chunk) > room:
                self._killed_for = self._killed_for or f"output over {self._limits.output_bytes} bytes (stderr)"
                self._signal(signal.SIGKILL)  # past the limit: keep nothing more, stop the writer

    async def _wait_exit(self) -> None:
        try:
            await asyncio.wait_for(self._process.wait(), EXIT_GRACE_S)
        except asyncio.TimeoutError:
            self._signal(signal.SIGKILL)

    async def _ended_without_done(self) -> ProgramResult:
        await self._wait_exit()
        await self._process.wait()
        rc = self._process.returncode
        # bwrap reports a program killed by a signal as 128 + the signal
        sig = rc - 128 if rc is not None and rc > 128 else (-rc if rc is not None and rc < 0 else None)
        if self._killed_for is not None:
            reason = self._killed_for
        elif self._process.cgroup.oom_kills():
            reason = (f"killed: memory limit ({self._limits.memory_bytes} bytes) reached; the limit counts every "
                      "page of the program: memfd, /tmp and page cache as well as its objects")
        elif sig == signal.SIGXCPU:
            reason = f"cpu time limit ({self._limits.cpu_seconds:g} s) exceeded"
        elif sig == signal.SIGKILL:
            # the hard RLIMIT_CPU: a program that ignored SIGXCPU
            reason = f"killed: cpu time limit ({self._limits.cpu_seconds:g} s) exceeded"
        elif sig == signal.SIGXFSZ:
            reason = f"file size limit ({self._limits.file_bytes} bytes) exceeded"
        elif sig is not None:
            reason = f"the program died of signal {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
        else:
            reason = f"the program exited ({rc}) before it ended"
        return await self._finish("incomplete", reason)

    async def _finish(self, status: Literal["completed", "incomplete"], error: str | None) -> ProgramResult:
        await self._reap()
        if status == "incomplete" and error is not None:
            stderr = bytes(self._stderr).decode(errors="replace").strip()
            if stderr:
                error += "\nstderr:\n" + stderr[-self._limits.output_bytes:]
        self._result = ProgramResult(status, self._text(), error)
        return self._result

    def _signal(self, sig: int) -> None:
        if self._process.returncode is None:
            try:
                # the whole group: unshare/bwrap's chain; the sandbox's own session dies with its PID
                # namespace's init (--die-with-parent)
                os.killpg(self._process.pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            self._process.cgroup.kill()  # and whatever is left in its cgroup

    async def _reap(self) -> None:
        self._signal(signal.SIGKILL)
        await self._process.wait()
        if self._to_runner >= 0:
            os.close(self._to_runner)
            self._to_runner = -1
        for transport in self._transports:
            transport.close()
        if self._peak is None:
            self._peak = self._process.cgroup.peak()
            await asyncio.to_thread(self._process.cgroup.remove)
        self.holds, self.parked_bytes = "nothing", 0
        if self._pool is not None:
            self._pool.programs.discard(self)
            self._pool.freed.set()
        try:
            # every writer is dead, so the pipe ends now; reading it to the end closes its transport
            await asyncio.wait_for(asyncio.shield(self._stderr_task), EXIT_GRACE_S)
        except asyncio.TimeoutError:
            self._stderr_task.cancel()
        self._batch.clear()
        self._parked = False
