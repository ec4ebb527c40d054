"""A response being made: the validated request, the conversation it continues, and what its
model turns have produced so far (also the state of each sub-agent of an Ultra response)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from wafer.agents.items import ResponseRequest
from wafer.agents.program import Program
from wafer.agents.ptc import Parked
from wafer.errors import APIError


@dataclass
class Plan:
    """A validated request: what the model turns need, and what the response echoes."""

    req: ResponseRequest
    rid: str
    created_at: int
    history: list[dict[str, Any]]  # earlier responses' input and output items, oldest first
    new_items: list[dict[str, Any]]
    chat_tools: list[dict[str, Any]]
    programmatic: list[dict[str, Any]]  # function tools a program may call
    ptc: bool
    tool_choice: str | dict[str, Any]
    response_format: dict[str, Any] | None
    resume: Parked | None = None
    running: list[Program] = field(default_factory=list)  # programs of this response not yet parked or ended
    task_before: dict[str, Any] = field(default_factory=dict)  # the totals of the responses before it
    started: float = field(default_factory=time.monotonic)
    failure: APIError | None = None  # why the response failed, for an HTTP error when it was not streamed
    agent: str = "root"  # which agent of an Ultra response this is
    tenant: str | None = None  # whose key asked for it (None on a server without keys)
    ultra: dict[str, Any] | None = None  # Ultra's settings (n, subagent_model), when it is on
    ultra_state: dict[str, Any] | None = None  # the sub-agents of the Ultra response this one resumes
    # Its answer draws on text it was given (Ultra's synthesis of its agents' results): the local
    # engine drafts it by prompt lookup.
    copies_input: bool = False
    step: asyncio.Future[Any] | None = None  # the body's step under way, which cancel() stops
    cancelled: bool = False  # DELETE stopped it before its end
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"input": 0, "cached": 0, "output": 0, "reasoning": 0})
    accounting: dict[str, Any] = field(default_factory=lambda: {
        "turns": [], "tool_calls": {"direct": 0, "programmatic": 0}, "programs": []})

    def cancel(self) -> None:
        self.cancelled = True
        if self.step is not None:
            self.step.cancel()


class Events:
    """The response's event stream: numbered events, and the items of `output` as they change."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return event
