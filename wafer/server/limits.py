"""A key's limits, kept in memory by the server that admits its requests: requests and tokens over
the last minute (a sliding window), requests running now, and tokens over the UTC day.

A request is admitted while the key is under each limit; its tokens (prompt and completion) count
when it ends, so the request that crosses a token limit is answered and the next one is refused.
A refused request counts toward nothing. Every answer of a limited route carries the headers
OpenAI sends (`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`) for the limits the key has,
and wafer's own for the day's budget (`-tokens-per-day`) and for concurrency
(`x-ratelimit-{limit,remaining}-concurrent-requests`); a 429 also has `Retry-After`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from wafer.errors import APIError
from wafer.server.key_store import ApiKey, seconds_to_midnight, today

WINDOW = 60.0  # seconds over which requests and tokens per minute are counted


def duration(seconds: float) -> str:
    """A time as OpenAI's reset headers write it: "12ms", "1.5s", "6m0s"."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, s = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    sec = f"{round(s, 3):g}s"
    return (f"{hours}h{minutes}m" if hours else f"{minutes}m" if minutes else "") + sec


class OverLimit(APIError):
    """A 429 for one of a key's limits: `limit` names it (requests, tokens, daily_tokens, concurrency)."""

    def __init__(self, limit: str, wait: float, message: str, type: str, code: str) -> None:
        super().__init__(429, message, type, None, code)
        self.limit = limit
        self.wait = wait


@dataclass
class _Use:
    requests: deque[float] = field(default_factory=deque)  # when each request of the window was admitted
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens) of each that ended
    token_sum: int = 0
    running: int = 0
    day: str = ""
    day_tokens: int = 0


class Limiter:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.use: dict[str, _Use] = {}

    def _use(self, key_id: str) -> _Use:
        u = self.use.get(key_id)
        if u is None:
            u = self.use[key_id] = _Use()
        now = self.clock()
        while u.requests and u.requests[0] <= now - WINDOW:
            u.requests.popleft()
        while u.tokens and u.tokens[0][0] <= now - WINDOW:
            u.token_sum -= u.tokens.popleft()[1]
        return u

    def knows_today(self, key: ApiKey) -> bool:
        """Whether the day's tokens of a key with a daily budget are known here (else: day_tokens)."""
        return key.daily_tokens is None or self._use(key.id).day == today(self.clock())

    def day_tokens(self, key_id: str, day: str, tokens: int) -> None:
        """The key's tokens of `day` as the store has them (other servers' and earlier runs' use)."""
        u = self._use(key_id)
        if u.day != day:
            u.day, u.day_tokens = day, tokens

    def admit(self, key: ApiKey) -> dict[str, str]:
        """Take one request of the key, returning the headers to answer with; a 429 (OverLimit) if the
        key is over a limit. The caller must `release` an admitted request when it ends."""
        u = self._use(key.id)
        now = self.clock()
        self._roll_day(u, now)
        refusal: OverLimit | None = None
        if key.rpm is not None and len(u.requests) >= key.rpm:
            wait = u.requests[0] + WINDOW - now
            refusal = OverLimit("requests", wait, f"Rate limit reached for requests per minute (RPM) of tenant "
                                f"{key.tenant}: Limit {key.rpm}, Used {len(u.requests)}, Requested 1. Please try "
                                f"again in {duration(wait)}.", "requests", "rate_limit_exceeded")
        elif key.tpm is not None and u.token_sum >= key.tpm:
            wait, left = 0.0, u.token_sum
            for at, n in u.tokens:  # until enough of the window's tokens have left it
                left -= n
                wait = at + WINDOW - now
                if left < key.tpm:
                    break
            refusal = OverLimit("tokens", wait, f"Rate limit reached for tokens per minute (TPM) of tenant "
                                f"{key.tenant}: Limit {key.tpm}, Used {u.token_sum}. Please try again in "
                                f"{duration(wait)}.", "tokens", "rate_limit_exceeded")
        elif key.daily_tokens is not None and u.day_tokens >= key.daily_tokens:
            wait = seconds_to_midnight(now)
            refusal = OverLimit("daily_tokens", wait, f"You exceeded your daily token budget (tenant {key.tenant}: "
                                f"Limit {key.daily_tokens}, Used {u.day_tokens}). It starts again at 00:00 UTC, "
                                f"in {duration(wait)}.", "insufficient_quota", "insufficient_quota")
        elif key.concurrency is not None and u.running >= key.concurrency:
            wait = 1.0
            refusal = OverLimit("concurrency", wait, f"Too many requests at once for tenant {key.tenant}: Limit "
                                f"{key.concurrency} concurrent requests. Please try again when one has finished.",
                                "requests", "rate_limit_exceeded")
        if refusal is not None:
            refusal.headers = {**self.headers(key), "Retry-After": str(max(1, math.ceil(refusal.wait)))}
            if refusal.limit == "daily_tokens":  # hours away: the SDKs' retries would only fail again
                refusal.headers["x-should-retry"] = "false"
            raise refusal
        u.requests.append(now)
        u.running += 1
        return self.headers(key)

    def release(self, key_id: str) -> None:
        u = self.use.get(key_id)
        if u is not None and u.running > 0:
            u.running -= 1

    def charge(self, key_id: str, tokens: int) -> None:
        """Tokens a request of the key has used (prompt and completion)."""
        if tokens <= 0:
            return
        u = self._use(key_id)
        now = self.clock()
        self._roll_day(u, now)
        u.tokens.append((now, tokens))
        u.token_sum += tokens
        u.day_tokens += tokens

    def _roll_day(self, u: _Use, now: float) -> None:
        day = today(now)
        if u.day != day:
            u.day, u.day_tokens = day, 0

    def headers(self, key: ApiKey) -> dict[str, str]:
        """The key's limits, what is left of them and when they are whole again."""
        u = self._use(key.id)
        now = self.clock()
        h: dict[str, str] = {}
        if key.rpm is not None:
            h["x-ratelimit-limit-requests"] = str(key.rpm)
            h["x-ratelimit-remaining-requests"] = str(max(0, key.rpm - len(u.requests)))
            h["x-ratelimit-reset-requests"] = duration(u.requests[-1] + WINDOW - now if u.requests else 0)
        if key.tpm is not None:
            h["x-ratelimit-limit-tokens"] = str(key.tpm)
            h["x-ratelimit-remaining-tokens"] = str(max(0, key.tpm - u.token_sum))
            h["x-ratelimit-reset-tokens"] = duration(u.tokens[-1][0] + WINDOW - now if u.tokens else 0)
        if key.daily_tokens is not None:
            h["x-ratelimit-limit-tokens-per-day"] = str(key.daily_tokens)
            h["x-ratelimit-remaining-tokens-per-day"] = str(max(0, key.daily_tokens - u.day_tokens))
            h["x-ratelimit-reset-tokens-per-day"] = duration(seconds_to_midnight(now))
        if key.concurrency is not None:
            h["x-ratelimit-limit-concurrent-requests"] = str(key.concurrency)
            h["x-ratelimit-remaining-concurrent-requests"] = str(max(0, key.concurrency - u.running))
        return h
