"""Programmatic tool calling: the program tool as a chat model sees it, and programs parked while
the client runs the tools they called.

Programs are Python: the models wafer serves (Qwen2.5-Coder above all) write it best, and the
sandbox's interpreter is the one the server already has. A chat model writes a program by calling
one more function, `run_program(code)`, under the same grammar as every tool call, so any chat
model with tool calling can use it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from wafer import untrusted_json
from wafer.agents.items import PROGRAM_TOOL
from wafer.agents.program import Program, ToolCall
from wafer.config import ProgramPoolSettings
from wafer.errors import APIError


def _signature(tool: dict[str, Any]) -> str:
    params = tool.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    args = ", ".join(f"{name}: {spec.get('type', 'any') if isinstance(spec, dict) else 'any'}"
                     + ("" if name in required else " = None") for name, spec in props.items())
    doc = (tool.get("description") or "").strip().replace("\n", " ")
    return f"async def {tool['name']}({args}) -> str" + (f"  # {doc}" if doc else "")


def program_tool(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat function through which the model writes a program over `tools` (Responses-style
    function tools that allow the programmatic caller). Small models need the example: without it
    they put the data they expect into `code`, or define the tools themselves."""
    listing = "\n".join(_signature(t) for t in tools)
    first = tools[0]
    arg = next(iter((first.get("parameters") or {}).get("properties") or {}), None)
    call = f"{first['name']}({arg}=value)" if arg else f"{first['name']}()"
    example = (f"results = []\nfor value in [...]:\n    results.append(await {call})\n"
               "print(len(results))")
    description = (
        "Runs Python code that you write. These async functions are already defined in it; call them with "
        "await:\n" + listing + "\nDo not define them yourself. In the code, call them as often as needed, with "
        "loops, asyncio.gather, try/except and arithmetic. Each returns the tool's result (parsed JSON "
        "where it is JSON, else a string). Only what the code prints comes back to you, so print just the "
        "final, short result.\nExample of code:\n" + example)
    return {"type": "function", "function": {
        "name": PROGRAM_TOOL, "description": description,
        "parameters": {"type": "object", "properties": {"code": {
            "type": "string", "description": "Python statements (top-level await works) that call the functions "
            "above and print the result"}}, "required": ["code"], "additionalProperties": False}}}


def program_code(arguments: str) -> str | None:
    """The code of a `run_program` call, None if its arguments do not hold one."""
    try:
        args = untrusted_json.loads(arguments)
    except ValueError:
        return None
    code = args.get("code") if isinstance(args, dict) else None
    return code if isinstance(code, str) else None


@dataclass
class Parked:
    program: Program
    call_id: str  # the program item's
    pending: dict[str, ToolCall]  # by call id: the calls the client owes outputs for
    response_id: str
    started: float
    deadline: float
    run_seconds: float = 0.0  # time the program ran (not parked) so far
    tenant: str | None = None  # whose key made its response: only that tenant's outputs resume it


class ProgramsBusy(APIError):
    """The server runs as many programs as it may at once: try again shortly."""

    def __init__(self, running: int) -> None:
        super().__init__(429, f"The server is running {running} programs, as many as it runs at once; retry shortly.",
                         "rate_limit_error", None, "programs_busy", {"Retry-After": "1"})


_DEFAULTS = ProgramPoolSettings()


@dataclass
class ProgramPool:
    """The server's programs: at most `max_running` run at once (one more to start is a
    ProgramsBusy, 429; one to resume waits for a program to park or end, its memory held as it was
    parked); parked ones, waiting for tool outputs, are at most `max_parked` holding at most
    `parked_memory_bytes` together (one more ends with an error), each for at most `park_seconds`;
    freed when their time runs out, when their response is deleted, and at shutdown."""

    max_running: int = _DEFAULTS.max_running
    max_parked: int = _DEFAULTS.max_parked
    park_seconds: float = _DEFAULTS.park_seconds
    parked_memory_bytes: int = _DEFAULTS.parked_memory_bytes
    parked: dict[str, Parked] = field(default_factory=dict)  # by program call id
    programs: set[Program] = field(default_factory=set)  # every live program started with this pool
    starting: int = 0  # admitted, not yet live
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # set when a program parks or ends
    _reaper: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, settings: ProgramPoolSettings) -> ProgramPool:
        """A pool with these bounds (wafer.toml's [sandbox] and `wafer serve`'s flags)."""
        return cls(**asdict(settings))

    @property
    def running(self) -> int:
        return self.starting + sum(1 for p in self.programs if p.holds == "running")

    @property
    def parked_bytes(self) -> int:
        return sum(p.parked_bytes for p in self.programs if p.holds == "parked")

    def admit(self) -> None:
        """One more program is to start or to resume: ProgramsBusy where `max_running` run."""
        if self.running >= self.max_running:
            raise ProgramsBusy(self.running)
        self.starting += 1

    def release(self) -> None:
        """An admitted program started (it counts as itself now) or failed to."""
        self.starting -= 1
        self.freed.set()

    async def wait_to_run(self) -> None:
        """Until fewer than `max_running` run (checked at least once a second: the limit may change)."""
        while self.running >= self.max_running:
            self.freed.clear()
            try:
                await asyncio.wait_for(self.freed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def parking_refused(self, nbytes: int) -> str | None:
        """Why a program holding `nbytes` cannot park, None when it can."""
        self._expire()
        if sum(1 for p in self.programs if p.holds == "parked") >= self.max_parked:
            return f"the server holds {self.max_parked} programs waiting for tool outputs, as many as it may"
        if self.parked_bytes + nbytes > self.parked_memory_bytes:
            return (f"waiting for its tool outputs, the program would hold {nbytes} bytes, and the programs "
                    f"waiting on this server would hold more than {self.parked_memory_bytes} bytes together")
        return None

    def park(self, p: Parked) -> None:
        self._expire()
        p.program.hold_parked()  # (a program claimed and put back holds running until here)
        p.deadline = time.monotonic() + self.park_seconds
        self.parked[p.call_id] = p
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def claim(self, output_ids: set[str], tenant: str | None = None) -> Parked | None:
        """The tenant's parked program that waits on any of these call ids, taken out of the pool (it
        holds its parked memory until it resumes)."""
        self._expire()
        for key, p in self.parked.items():
            if p.tenant == tenant and output_ids & p.pending.keys():
                return self.parked.pop(key)
        return None

    def drop_response(self, response_id: str) -> None:
        for key in [k for k, p in self.parked.items() if p.response_id == response_id]:
            self._free(key)

    def _free(self, key: str) -> None:
        p = self.parked.pop(key, None)
        if p is not None:
            asyncio.get_running_loop().create_task(p.program.kill())

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self.parked.items() if p.deadline <= now]:
            self._free(key)

    async def _reap(self) -> None:
        while self.parked:
            # At least once a second: a deadline may have been brought forward (a pool made stricter).
            await asyncio.sleep(min(min(p.deadline for p in self.parked.values()) - time.monotonic() + 0.05, 1.0))
            self._expire()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        programs = [p.program for p in self.parked.values()]
        self.parked.clear()
        await asyncio.gather(*(p.kill() for p in programs), return_exceptions=True)
