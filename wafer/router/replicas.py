"""Several copies of one model behind one name: which replica answers, and what happens when one fails.

An upstream in wafer.toml may list `replicas` (the base URLs of wafer servers, or of any OpenAI-
compatible servers, that serve the same model) instead of one base_url. Each request goes to one
healthy replica, picked by the upstream's `policy`:
- `least_outstanding` (the default): the fewest requests in flight from this router, ties in turn;
- `prefix`: the replica that already served the longest prefix of this request's conversation (its
  messages, or its prompt in chunks), when that prefix is at least half the request, as SGLang's
  cache-aware router does: one chat's or one agent's history then stays in one replica's prefix
  cache. Unless that replica has `balance_slack` more requests in flight than the least loaded one;
  then, and when nothing matches, least outstanding.
A replica that fails (no connection, a timeout, a 5xx, a body outside the API's shape) is cooled down
for `cooldown` seconds, twice as long each time it fails again in a row (up to 16 times), and the
request goes on to the next replica. Only failures before any byte reached the client are retried,
so a stream is never sent twice. Every `health_interval` seconds the router asks each replica's
/health (a 404 counts as alive: not every server has one): one that fails is cooled down, one that
answers while cooling comes back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from wafer.router.config import UpstreamConfig
from wafer.router.upstream import UpstreamReply, UpstreamUnavailable, forward

PREFIXES_KEPT = 10_000  # conversation prefixes remembered per replica, least recently used dropped
PROMPT_CHUNK = 512  # characters: a legacy completion's prompt is matched in pieces of this size
AFFINITY = 0.5  # share of the request's characters a replica must have seen for the prefix policy
MAX_BACKOFF = 16


@dataclass
class Replica:
    url: str
    outstanding: int = 0  # requests in flight from this router
    requests: int = 0
    errors: int = 0
    failures_in_row: int = 0
    cooled_until: float = 0.0
    down_by_health: bool = False  # cooled because /health failed (an answer there brings it back)
    prefixes: OrderedDict[str, None] = field(default_factory=OrderedDict)


def prefix_keys(body: dict[str, Any]) -> list[tuple[str, int]]:
    """(key, characters so far) for each prefix of the request's conversation: one per message of a
    chat, one per chunk of a prompt, each key a hash of everything up to it."""
    if isinstance(body.get("messages"), list):
        pieces = [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in body["messages"]]
    elif isinstance(body.get("prompt"), str):
        p = body["prompt"]
        pieces = [p[i : i + PROMPT_CHUNK] for i in range(0, len(p), PROMPT_CHUNK)]
    else:
        return []
    keys, h, size = [], hashlib.blake2b(digest_size=16), 0
    for piece in pieces:
        h.update(piece.encode("utf-8", "surrogatepass"))
        size += len(piece)
        keys.append((h.copy().hexdigest(), size))
    return keys


class ReplicaSet:
    """The replicas of one upstream and the choice between them."""

    def __init__(self, up: UpstreamConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.up = up
        self.replicas = [Replica(url.rstrip("/")) for url in up.replicas]
        self.clock = clock
        self._turn = 0

    def healthy(self) -> list[Replica]:
        now = self.clock()
        return [r for r in self.replicas if r.cooled_until <= now]

    def order(self, keys: list[tuple[str, int]]) -> list[Replica]:
        """The replicas to try, the chosen one first; cooling ones last (tried only when every
        healthy one has failed this request)."""
        healthy = self.healthy()
        cooling = sorted((r for r in self.replicas if r not in healthy), key=lambda r: r.cooled_until)
        if not healthy:
            return cooling
        self._turn += 1
        rotated = healthy[self._turn % len(healthy):] + healthy[: self._turn % len(healthy)]
        by_load = sorted(rotated, key=lambda r: r.outstanding)  # stable: ties keep their turn
        first = by_load[0]
        if self.up.policy == "prefix" and keys:
            total = keys[-1][1]
            best, seen = None, 0
            for r in healthy:
                matched = next((size for key, size in reversed(keys) if key in r.prefixes), 0)
                if matched > seen:
                    best, seen = r, matched
            if best is not None and seen >= AFFINITY * total and \
                    best.outstanding <= first.outstanding + self.up.balance_slack:
                first = best
        return [first, *(r for r in by_load if r is not first), *cooling]

    def remember(self, replica: Replica, keys: list[tuple[str, int]]) -> None:
        for key, _ in keys:
            replica.prefixes[key] = None
            replica.prefixes.move_to_end(key)
        while len(replica.prefixes) > PREFIXES_KEPT:
            replica.prefixes.popitem(last=False)

    def failed(self, replica: Replica) -> None:
        replica.errors += 1
        replica.failures_in_row += 1
        backoff = min(MAX_BACKOFF, 2 ** (replica.failures_in_row - 1))
        replica.cooled_until = self.clock() + self.up.cooldown * backoff

    def alive(self, replica: Replica) -> None:
        replica.failures_in_row = 0
        replica.cooled_until = 0.0
        replica.down_by_health = False

    async def forward(self, client: httpx.AsyncClient, path: str,
                      body: dict[str, Any]) -> tuple[UpstreamReply, Replica]:
        """The first replica's answer that could be passed on, trying the next on a failure. Raises
        UpstreamUnavailable when none could answer."""
        keys = prefix_keys(body)
        failures = []
        for replica in self.order(keys):
            up = dataclasses.replace(self.up, name=f"{self.up.name} ({replica.url})", base_url=replica.url)
            replica.outstanding += 1
            replica.requests += 1
            try:
                reply = await forward(client, up, path, body)
            except UpstreamUnavailable as e:
                replica.outstanding -= 1
                self.failed(replica)
                failures.append(str(e))
                continue
            except BaseException:
                replica.outstanding -= 1
                raise
            self.alive(replica)
            self.remember(replica, keys)
            if reply.stream is None:
                replica.outstanding -= 1
            else:
                reply.stream = self._counted(replica, reply.stream)
            return reply, replica
        raise UpstreamUnavailable("; ".join(failures) or f"{self.up.name}: no replica")

    async def _counted(self, replica: Replica, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        finally:
            replica.outstanding -= 1

    async def check_health(self, client: httpx.AsyncClient) -> None:
        """GET /health of every replica (the server's root: its base URL without /v1)."""

        async def one(r: Replica) -> None:
            root = r.url[: -len("/v1")] if r.url.endswith("/v1") else r.url
            try:
                resp = await client.get(root + "/health", timeout=min(5.0, self.up.timeout))
                ok = resp.status_code < 500
            except httpx.HTTPError:
                ok = False
            if ok and r.down_by_health:
                r.down_by_health = False
                self.alive(r)
            elif not ok and r.cooled_until <= self.clock():
                r.down_by_health = True
                self.failed(r)

        await asyncio.gather(*(one(r) for r in self.replicas))
