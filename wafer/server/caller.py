"""Who sent the request being handled: the tenant of its key, and that key. Set when the key is
checked; a context variable, so that what runs for the request (a stream's body, the agents' model
turns, Ultra's sub-agents) charges its tokens to that tenant."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wafer.server.key_store import ApiKey


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None on a server without keys
    key: "ApiKey | None" = None  # a key of the state database (None: a key of --api-key, or no keys)
    admin: bool = False  # may read /metrics and the dashboard
    # A Batch API line's work: the tenant's use, written apart (`wafer keys usage` shows it as the key's
    # id and `/batch`), and outside the key's rate limits, as OpenAI keeps the Batch API's limits apart.
    batch: bool = False


CALLER: ContextVar[Caller | None] = ContextVar("wafer_caller", default=None)


def current_caller() -> Caller | None:
    return CALLER.get()
