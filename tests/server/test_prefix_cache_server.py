"""Prefix caching through the server: a multi-turn chat replayed with the openai SDK finds, from
turn 2 on, everything the previous turn computed in the cache, and answers as without the cache."""

from __future__ import annotations

import pytest

from bench.prefix_cache import expected_cached, replay
from tests.serving import MODEL, start_server


@pytest.fixture(scope="module")
def uncached_server(smollm):
    s = start_server(smollm, max_running=2, engine_kw={"prefix_caching": False})
    yield s
    s.stop()


def test_multi_turn_replay_reuses_the_history(smollm, uncached_server):
    cached_server = start_server(smollm, max_running=2)
    try:
        cached = replay(cached_server.base_url + "/v1", MODEL, turns=5, max_tokens=16)
        assert cached_server.engine.blocks.prefix_hit_rate > 0.5
    finally:
        cached_server.stop()
    plain = replay(uncached_server.base_url + "/v1", MODEL, turns=5, max_tokens=16)
    want = expected_cached(cached)
    assert cached[0].cached_tokens == 0
    for turn, w in zip(cached[1:], want[1:]):
        assert turn.cached_tokens == w
    assert all(t.cached_tokens == 0 for t in plain)
    assert [t.text for t in cached] == [t.text for t in plain]
    assert [t.prompt_tokens for t in cached] == [t.prompt_tokens for t in plain]
