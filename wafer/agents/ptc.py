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
from dataclasses import dataclass, field
from typing import Any

from wafer import untrusted_json
from wafer.agents.items import PROGRAM_TOOL
from wafer.agents.program import Program, ToolCall


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


@dataclass
class ProgramPool:
    """Programs waiting for tool outputs: at most `max_parked`, each for at most `park_seconds`;
    freed when their time runs out, when their response is deleted, and at shutdown."""

    max_parked: int = 64
    park_seconds: float = 600.0
    parked: dict[str, Parked] = field(default_factory=dict)  # by program call id
    _reaper: asyncio.Task[None] | None = None

    def park(self, p: Parked) -> None:
        self._expire()
        while len(self.parked) >= self.max_parked:  # the oldest makes room
            oldest = min(self.parked.values(), key=lambda x: x.started)
            self._free(oldest.call_id)
        p.deadline = time.monotonic() + self.park_seconds
        self.parked[p.call_id] = p
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def claim(self, output_ids: set[str], tenant: str | None = None) -> Parked | None:
        """The tenant's parked program that waits on any of these call ids, taken out of the pool."""
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
