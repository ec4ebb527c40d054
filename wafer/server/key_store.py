"""API keys of tenants, and their use by day, in the state database (`--state-db`, beside the
stored responses): `wafer keys` writes them, the server reads them on every request.

A key is shown once, when it is made, and stored as its SHA-256 only: a key is 256 random bits, so
a fast hash is as safe as a slow one and lets a request find its key by an index lookup. The
lookup's hash is then compared with `hmac.compare_digest`, in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Boolean, Float, Integer, String, Text, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from wafer.agents.store import open_database

KEY_PREFIX = "wf-"  # what a wafer key starts with, so that a leaked one is recognisable (as OpenAI's "sk-")
SHOWN_CHARS = 8  # characters of a key that `wafer keys list` shows, to tell keys apart


class _Base(DeclarativeBase):
    pass


class _Key(_Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)  # SHA-256 of the key, hex
    shown: Mapped[str] = mapped_column(String(16))  # the key's first characters
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    concurrency: Mapped[int | None] = mapped_column(Integer, nullable=True)
    daily_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    models: Mapped[str | None] = mapped_column(Text, nullable=True)  # a JSON list, or None for all
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class _Usage(_Base):
    __tablename__ = "api_key_usage"
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # UTC, YYYY-MM-DD
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    requests: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    rate_limited: Mapped[int] = mapped_column(Integer, default=0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)


@dataclass(frozen=True)
class ApiKey:
    """A key as the server sees it: its tenant, whether it may read the server's monitoring, and its
    limits (None: none)."""

    id: str
    tenant: str
    shown: str
    admin: bool = False
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt and completion) per minute
    concurrency: int | None = None  # requests at once
    daily_tokens: int | None = None  # tokens per UTC day
    models: tuple[str, ...] | None = None  # the model names it may ask for
    created_at: float = 0.0
    revoked_at: float | None = None

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.concurrency, self.daily_tokens))


@dataclass
class Usage:
    """A key's use over a day (or what is not yet written of it)."""

    tenant: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0
    rate_limited: int = 0
    cost_usd: float = 0.0

    def add(self, other: "Usage") -> None:
        for f in ("requests", "input_tokens", "output_tokens", "errors", "rate_limited", "cost_usd"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def digest(key: str | bytes) -> str:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).hexdigest()


def today(now: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).strftime("%Y-%m-%d")


def seconds_to_midnight(now: float | None = None) -> float:
    """Seconds until the next UTC day, when daily budgets start again."""
    at = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    midnight = (at + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (midnight - at).total_seconds()


def _key(row: _Key) -> ApiKey:
    return ApiKey(row.id, row.tenant, row.shown, bool(row.admin), row.rpm, row.tpm, row.concurrency,
                  row.daily_tokens, tuple(json.loads(row.models)) if row.models else None, row.created_at,
                  row.revoked_at)


class KeyStore:
    """Keys and usage over SQLAlchemy: calls are synchronous and short (the server runs them in a
    worker thread)."""

    def __init__(self, where: str | Path | None = None) -> None:
        self.url, self.engine = open_database(where)
        _Base.metadata.create_all(self.engine)

    def add(self, tenant: str, admin: bool = False, rpm: int | None = None, tpm: int | None = None,
            concurrency: int | None = None, daily_tokens: int | None = None,
            models: list[str] | None = None) -> tuple[str, ApiKey]:
        """A new key for `tenant`: the key itself (shown once, never stored) and its record."""
        if not tenant or len(tenant) > 128:
            raise ValueError("a tenant name has 1 to 128 characters")
        for name, v in (("rpm", rpm), ("tpm", tpm), ("concurrency", concurrency), ("daily_tokens", daily_tokens)):
            if v is not None and v < 1:
                raise ValueError(f"{name} must be 1 or more, not {v}")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        row = _Key(id="key_" + secrets.token_hex(6), hash=digest(secret), shown=secret[:SHOWN_CHARS], tenant=tenant,
                   admin=admin, rpm=rpm, tpm=tpm, concurrency=concurrency, daily_tokens=daily_tokens,
                   models=json.dumps(models) if models else None, created_at=time.time(), revoked_at=None)
        with Session(self.engine) as s, s.begin():
            s.add(row)
            s.flush()
            return secret, _key(row)

    def find(self, key_hash: str) -> ApiKey | None:
        """The live (not revoked) key whose SHA-256 is `key_hash`."""
        with Session(self.engine) as s:
            row = s.execute(select(_Key).where(_Key.hash == key_hash)).scalar_one_or_none()
            if row is None or not hmac.compare_digest(row.hash, key_hash) or row.revoked_at is not None:
                return None
            return _key(row)

    def keys(self, revoked: bool = True) -> list[ApiKey]:
        with Session(self.engine) as s:
            q = select(_Key).order_by(_Key.tenant, _Key.created_at)
            if not revoked:
                q = q.where(_Key.revoked_at.is_(None))
            return [_key(r) for r in s.execute(q).scalars()]

    def revoke(self, ref: str) -> list[ApiKey]:
        """Revoke a key by id, or every live key of a tenant by its name; returns those revoked."""
        with Session(self.engine) as s, s.begin():
            rows = list(s.execute(select(_Key).where((_Key.id == ref) | (_Key.tenant == ref),
                                                     _Key.revoked_at.is_(None))).scalars())
            now = time.time()
            for r in rows:
                r.revoked_at = now
            return [_key(r) for r in rows]

    def tokens_on(self, key_id: str, day: str) -> int:
        """Tokens the key has used on `day`, as written so far."""
        with Session(self.engine) as s:
            row = s.get(_Usage, (day, key_id))
            return 0 if row is None else row.input_tokens + row.output_tokens

    def record(self, usage: dict[tuple[str, str], Usage]) -> None:
        """Add use by (day, key id) to what is written."""
        fields = ("requests", "input_tokens", "output_tokens", "errors", "rate_limited", "cost_usd")
        with Session(self.engine) as s, s.begin():
            for (day, key_id), u in usage.items():
                done = s.execute(update(_Usage).where(_Usage.day == day, _Usage.key_id == key_id).values(
                    **{f: getattr(_Usage, f) + getattr(u, f) for f in fields})).rowcount
                if not done:
                    s.add(_Usage(day=day, key_id=key_id, tenant=u.tenant, **{f: getattr(u, f) for f in fields}))

    def usage(self, since: str, tenant: str | None = None) -> list[tuple[str, str, Usage]]:
        """(day, key id, use) from `since` (a day) on, oldest first."""
        with Session(self.engine) as s:
            q = select(_Usage).where(_Usage.day >= since).order_by(_Usage.day, _Usage.tenant, _Usage.key_id)
            if tenant is not None:
                q = q.where(_Usage.tenant == tenant)
            return [(r.day, r.key_id, Usage(r.tenant, r.requests, r.input_tokens, r.output_tokens, r.errors,
                                            r.rate_limited, r.cost_usd)) for r in s.execute(q).scalars()]

    def close(self) -> None:
        self.engine.dispose()


def describe(row: Any) -> str:
    """A key's limits in words, for `wafer keys list`."""
    parts = [f"{n} {v}" for n, v in (("rpm", row.rpm), ("tpm", row.tpm), ("concurrency", row.concurrency),
                                      ("tokens/day", row.daily_tokens)) if v is not None]
    if row.models:
        parts.append("models " + ",".join(row.models))
    return ", ".join(parts) or "no limits"
