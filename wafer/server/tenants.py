"""Tenants: who a request is (its bearer key), what it may do (its limits, its models), and what it
used (tokens, cost, errors: in /metrics, and by day in the state database for `wafer keys usage`).

Keys come from two places:
- the state database (`wafer keys add`): each names its tenant, its limits, and whether it is an
  admin key. It is looked up on every request, so that a revoked key is refused at once, by every
  server that shares the database.
- `--api-key`, `$WAFER_API_KEY` and `--api-key-file`: each is a tenant of its own, named
  `key-` and the first 8 hex digits of the key's SHA-256, with no limits, and an admin key.

Checked in constant time: the given key's SHA-256 is looked up, and compared with
`hmac.compare_digest`; the server keeps no key in plain text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
from pathlib import Path

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wafer.errors import APIError
from wafer.server.caller import CALLER, Caller
from wafer.server.key_store import ApiKey, KeyStore, Usage, digest, today
from wafer.server.limits import Limiter, OverLimit
from wafer.server.metrics import ServerMetrics

log = logging.getLogger("wafer.server")

FLUSH_SECONDS = 1.0  # how often use is written to the state database
BATCH_USE = "/batch"  # a key's batch lines' use is written under its id and this


def legacy_tenant(key_hash: str) -> str:
    return f"key-{key_hash[:8]}"


def keys_in(where: str | Path | None) -> KeyStore | None:
    """The state database's keys when it holds any (a SQLite file is not made for it)."""
    from wafer.agents.store import default_path

    if not (isinstance(where, str) and "://" in where):
        path = Path(where) if where else default_path()
        if not path.exists():
            return None
    store = KeyStore(where if where else None)
    if not store.keys(revoked=False):
        store.close()
        return None
    return store


class Tenancy:
    """The keys of a server and the dependencies that check them."""

    def __init__(self, legacy_keys: list[str], store: KeyStore | None, metrics: ServerMetrics,
                 protect_metrics: bool = False) -> None:
        self.legacy = [(h, legacy_tenant(h)) for h in (digest(k) for k in legacy_keys)]
        self.store = store
        self.metrics = metrics
        self.protect_metrics = protect_metrics
        self.limiter = Limiter()
        self.pending: dict[tuple[str, str], Usage] = {}  # use not yet written, by (day, key id)
        metrics.usage_hooks.append(self._charge)
        metrics.error_hooks.append(self._error)

    @property
    def on(self) -> bool:
        """Whether requests need a key."""
        return bool(self.legacy) or self.store is not None

    # --- who ---------------------------------------------------------------------------------
    async def _identify(self, request: Request, basic: bool = False, challenge_basic: bool = False) -> Caller:
        """`basic`: the key may come as an HTTP Basic password; `challenge_basic`: a 401 asks for one."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        challenge = {"WWW-Authenticate": 'Basic realm="wafer"' if challenge_basic else "Bearer"}  # RFC 7617 / 6750
        if not header:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           "invalid_request_error", None, "invalid_api_key", challenge)
        # Bytes: any client may send a header that is not ASCII (Starlette decoded it as latin-1).
        given = token.strip().encode("latin-1", "replace")
        if basic and scheme.lower() == "basic":  # a browser's, for the dashboard: the key is the password
            try:
                given = base64.b64decode(given, validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                given = b""
        elif scheme.lower() != "bearer":
            given = b""
        found: Caller | None = None
        if given:
            h = digest(given)
            for key_hash, tenant in self.legacy:  # every one compared, whichever matches
                if hmac.compare_digest(key_hash, h):
                    found = Caller(tenant, None, True)
            if found is None and self.store is not None:
                key = await asyncio.to_thread(self.store.find, h)
                if key is not None:
                    found = Caller(key.tenant, key, key.admin)
                    if not self.limiter.knows_today(key):  # its first request here today
                        day = today(self.limiter.clock())
                        self.limiter.day_tokens(key.id, day, await asyncio.to_thread(self.store.tokens_on, key.id, day))
        if found is None:
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key",
                           challenge)
        return found

    # --- dependencies ------------------------------------------------------------------------
    async def authorize(self, request: Request) -> None:
        """Any key of the server (a dependency, not middleware: Starlette's BaseHTTPMiddleware would
        hide client disconnects from the handlers). Sets `request.state.tenant` (None without keys)."""
        caller = await self._identify(request) if self.on else Caller(None)
        request.state.caller = caller
        request.state.tenant = caller.tenant
        CALLER.set(caller)

    async def admit(self, request: Request) -> None:
        """A generating request: within its key's limits (after `authorize`)."""
        caller: Caller = request.state.caller
        if caller.tenant is not None:
            self.metrics.tenant_requests.labels(caller.tenant).inc()
        if caller.key is None:
            return
        try:
            headers = self.limiter.admit(caller.key)
        except OverLimit as e:
            self.metrics.tenant_limited.labels(caller.tenant, e.limit).inc()
            self._use(caller.key).rate_limited += 1
            raise
        request.state.admitted = caller.key.id  # the Gate releases it when the response has ended
        request.state.ratelimit_headers = headers
        self._use(caller.key).requests += 1

    async def monitor(self, request: Request) -> None:
        """/metrics and the dashboard: an admin key where the database has keys; any key of
        --api-key with --protect-metrics; else open. A browser may send the key as a Basic
        password (it asks for one on the 401)."""
        await self._monitor(request, False)

    async def monitor_page(self, request: Request) -> None:
        """The dashboard's page: as `monitor`, its 401 asking a browser for the key (as a password)."""
        await self._monitor(request, True)

    async def _monitor(self, request: Request, page: bool) -> None:
        if self.store is None and not (self.protect_metrics and self.legacy):
            return
        caller = await self._identify(request, basic=True, challenge_basic=page)
        if not caller.admin:
            raise APIError(403, "This key may not read the server's metrics: an admin key (`wafer keys add NAME "
                           "--admin`) may.", "invalid_request_error", None, "forbidden")

    def allows(self, model: str, aliases: dict[str, str]) -> bool:
        """Whether the request being handled may ask for `model` (or the name it stands for)."""
        caller = CALLER.get()
        if caller is None or caller.key is None or caller.key.models is None:
            return True
        return model in caller.key.models or aliases.get(model) in caller.key.models

    # --- use ---------------------------------------------------------------------------------
    def _use(self, key: ApiKey, batch: bool = False) -> Usage:
        slot = (today(self.limiter.clock()), key.id + BATCH_USE if batch else key.id)
        u = self.pending.get(slot)
        if u is None:
            u = self.pending[slot] = Usage(key.tenant)
        return u

    def _charge(self, caller: Caller, prompt: int, completion: int, cost: float) -> None:
        if caller.key is None:
            return
        if not caller.batch:
            self.limiter.charge(caller.key.id, prompt + completion)
        u = self._use(caller.key, caller.batch)
        u.input_tokens += prompt
        u.output_tokens += completion
        u.cost_usd += cost

    def _error(self, caller: Caller, status: int) -> None:
        if caller.key is not None:
            self._use(caller.key, caller.batch).errors += 1

    def release(self, key_id: str) -> None:
        self.limiter.release(key_id)

    async def flush(self) -> None:
        """Write the use so far to the state database."""
        if not self.pending or self.store is None:
            return
        pending, self.pending = self.pending, {}
        try:
            await asyncio.to_thread(self.store.record, pending)
        except Exception:  # noqa: BLE001 - the database is away: keep the use for the next flush
            log.exception("could not write the keys' use to the state database")
            for slot, u in pending.items():
                self.pending.setdefault(slot, Usage(u.tenant)).add(u)

    async def keep_writing(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            await self.flush()


class Gate:
    """Around every request: adds the rate-limit headers of an admitted request to its answer,
    counts its tenant's errors, and releases the request from its key's concurrency when its
    response has ended (a stream's included)."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy) -> None:
        self.app = app
        self.tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                state = scope.get("state") or {}
                extra = state.get("ratelimit_headers")
                if extra:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in extra.items())]}
                caller = state.get("caller")
                if caller is not None and caller.tenant is not None and message["status"] >= 400 \
                        and message["status"] != 499:
                    self.tenancy.metrics.tenant_error(caller, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            admitted = (scope.get("state") or {}).get("admitted")
            if admitted is not None:
                self.tenancy.release(admitted)
