"""A key's limits in memory, on a clock the test moves: each limit refuses the request after the one
that reached it, with the headers and Retry-After that say when it is whole again."""

from __future__ import annotations

import pytest

from wafer.errors import APIError
from wafer.server.key_store import ApiKey
from wafer.server.limits import Limiter, duration


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_durations_as_openai_writes_them():
    assert [duration(x) for x in (0, 0.012, 1, 1.5, 60, 360, 3725.25)] == [
        "0ms", "12ms", "1s", "1.5s", "1m0s", "6m0s", "1h2m5.25s"]


def test_requests_per_minute_slide():
    clock = Clock()
    lim, key = Limiter(clock), ApiKey("k", "alice", "wf-x", rpm=2)
    assert lim.admit(key)["x-ratelimit-remaining-requests"] == "1"
    clock.now += 20
    h = lim.admit(key)
    assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "1m0s"
    clock.now += 10
    with pytest.raises(APIError) as e:
        lim.admit(key)
    assert e.value.status == 429 and e.value.type == "requests" and e.value.code == "rate_limit_exceeded"
    assert e.value.limit == "requests"
    assert e.value.headers["Retry-After"] == "30"  # when the first request leaves the window
    clock.now += 30
    assert lim.admit(key)["x-ratelimit-remaining-requests"] == "0"  # the first left; refused ones never counted


def test_tokens_per_minute_count_when_a_request_ends():
    clock = Clock()
    lim, key = Limiter(clock), ApiKey("k", "alice", "wf-x", tpm=100)
    lim.admit(key)
    lim.charge("k", 60)
    clock.now += 5
    assert lim.admit(key)["x-ratelimit-remaining-tokens"] == "40"
    lim.charge("k", 60)  # the request that crosses the limit was admitted, and is answered
    with pytest.raises(APIError) as e:
        lim.admit(key)
    assert e.value.type == "tokens" and e.value.headers["x-ratelimit-remaining-tokens"] == "0"
    assert e.value.headers["Retry-After"] == "55"  # the first 60 leave and 60 < 100
    clock.now += 55
    assert lim.admit(key)["x-ratelimit-remaining-tokens"] == "40"


def test_the_daily_budget_is_a_quota_until_midnight_and_says_not_to_retry():
    clock = Clock()
    lim, key = Limiter(clock), ApiKey("k", "alice", "wf-x", daily_tokens=50)
    lim.day_tokens("k", "1970-01-12", 45)  # the store's count for the day (clock: 1970-01-12 13:46:40 UTC)
    lim.admit(key)
    lim.charge("k", 10)
    with pytest.raises(APIError) as e:
        lim.admit(key)
    assert e.value.code == "insufficient_quota" and e.value.headers["x-should-retry"] == "false"
    assert e.value.headers["Retry-After"] == str(86400 - 1_000_000 % 86400)
    assert e.value.headers["x-ratelimit-remaining-tokens-per-day"] == "0"
    clock.now += 86400
    lim.admit(key)  # a new day


def test_concurrency_counts_requests_until_released():
    lim, key = Limiter(Clock()), ApiKey("k", "alice", "wf-x", concurrency=1)
    assert lim.admit(key)["x-ratelimit-remaining-concurrent-requests"] == "0"
    with pytest.raises(APIError) as e:
        lim.admit(key)
    assert e.value.headers["Retry-After"] == "1"
    lim.release("k")
    lim.admit(key)
