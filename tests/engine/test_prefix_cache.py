"""Prefix caching: a later prompt that starts like an earlier sequence skips that prefill, gives the
same greedy output as without the cache, warm slots are evicted least recently used, and a running
sequence shares its prefix."""

from __future__ import annotations

from wafer.engine.engine import EngineConfig, LLMEngine
from wafer.engine.kv_cache import _common_prefix
from wafer.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def render(loaded, messages) -> list[int]:
    return loaded.tokenizer.encode(loaded.chat_template.render(messages), add_special_tokens=False)


def test_multi_turn_reuses_history_and_matches_uncached(smollm):
    cached = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=1024))
    plain = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=1024, prefix_caching=False))
    history = [{"role": "user", "content": "Name a famous painter."}]
    first_prompt: list[int] = []
    previous: list[int] = []  # what the previous turn's KV holds
    for turn in range(3):
        ids = render(smollm, history)
        a = cached.generate([ids], GREEDY)[0]
        b = plain.generate([ids], GREEDY)[0]
        assert a.output_ids == b.output_ids
        assert b.num_cached_prompt == 0
        if turn:
            # Everything the previous turn computed that this prompt repeats came from the cache.
            assert a.num_cached_prompt == min(_common_prefix(previous, ids), len(ids) - 1)
            assert a.num_cached_prompt > len(first_prompt)
        else:
            first_prompt = ids
        previous = a.tokens[: len(a.tokens) - 1]
        history += [{"role": "assistant", "content": a.text}, {"role": "user", "content": "And another one?"}]
    assert cached.kv.prefix_hit_rate > 0.5


def test_lru_eviction_and_reuse_of_evicted_slots(smollm):
    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512))
    fresh = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, prefix_caching=False))
    x, y, z = (render(smollm, [{"role": "user", "content": q}]) for q in
               ("Tell me about cats.", "Tell me about dogs.", "Why is the sea salty?"))
    sx = engine.generate([x], GREEDY)[0]
    sy = engine.generate([y], GREEDY)[0]  # shares a prefix with x: copied into the cold slot, x stays warm
    assert sy.num_cached_prompt == _common_prefix(x, y) >= 16
    assert sy.output_ids == fresh.generate([y], GREEDY)[0].output_ids
    assert engine.kv.num_used == 0 and engine.kv.num_free == 2  # both slots warm, both available
    hit = engine.generate([y], GREEDY)[0]  # y is warm: reused; now x is the least recently used
    assert hit.num_cached_prompt == len(y) - 1
    # z shares only the template's system prompt with x and y and no cold slot is left: of equal
    # matches the least recently used slot (x's) is taken over, so x's KV is evicted.
    sz = engine.generate([z], GREEDY)[0]
    assert sz.num_cached_prompt == _common_prefix(x, z) >= 16
    assert sz.output_ids == fresh.generate([z], GREEDY)[0].output_ids
    again = engine.generate([x], GREEDY)[0]  # x is gone: only what it shares with y or z is reused
    assert again.num_cached_prompt == max(_common_prefix(x, y), _common_prefix(x, z)) < len(x) - 1
    assert again.output_ids == sx.output_ids


def test_running_sequence_shares_its_prefix_with_a_newcomer(smollm):
    """Agents fanned out with one long system prompt: the second copies what the first computed."""
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    a, b = (render(smollm, [system, {"role": "user", "content": q}]) for q in ("Name a fruit.", "Name a colour."))
    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512))
    fresh = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, prefix_caching=False))
    sa = engine.add(a, GREEDY)
    engine.step()  # a's prompt is computed; a is still running
    assert not sa.finished
    sb = engine.add(b, GREEDY)
    while not (sa.finished and sb.finished):
        engine.step()
    assert sb.num_cached_prompt == _common_prefix(a, b) > 100
    ref = fresh.generate([a, b], GREEDY)
    assert [sa.output_ids, sb.output_ids] == [r.output_ids for r in ref]
