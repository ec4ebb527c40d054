"""Prefix caching: a later prompt that starts like an earlier sequence skips that prefill (in whole
blocks), gives the same greedy output as without the cache, cached blocks give their storage least
recently freed first when the budget is short, and a running sequence shares its prefix."""

from __future__ import annotations

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.kv_layout import BLOCK, bytes_per_token, kv_dtype
from wafer.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def reusable(held: list[int], prompt: list[int]) -> int:
    """Tokens of `prompt` a sequence that held the KV of `held` lets it skip: the whole blocks of
    their common prefix before the prompt's last token."""
    n = 0
    while n < min(len(held), len(prompt) - 1) and held[n] == prompt[n]:
        n += 1
    return n // BLOCK * BLOCK


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
            assert a.num_cached_prompt == reusable(previous, ids)
            assert a.num_cached_prompt > len(first_prompt)
        else:
            first_prompt = ids
        previous = a.tokens[: len(a.tokens) - 1]
        history += [{"role": "assistant", "content": a.text}, {"role": "user", "content": "And another one?"}]
    assert cached.kv.blocks.prefix_hit_rate > 0.5


def test_cached_blocks_are_evicted_least_recently_freed_first(smollm):
    x, y, z = (render(smollm, [{"role": "user", "content": q}]) for q in
               ("Tell me about cats.", "Tell me about dogs.", "Why is the sea salty? Explain it in a few words."))
    fresh = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, prefix_caching=False))
    roomy = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512))
    sx = roomy.generate([x], GREEDY)[0]
    sy = roomy.generate([y], GREEDY)[0]  # shares the template's system prompt with x
    assert sy.num_cached_prompt == reusable(x, y) >= 16
    assert sy.output_ids == fresh.generate([y], GREEDY)[0].output_ids
    assert roomy.kv.blocks.num_used == 0 and roomy.kv.blocks.usage == 0.0  # nothing held; both prefixes findable
    hit = roomy.generate([y], GREEDY)[0]
    assert hit.num_cached_prompt == reusable(sy.tokens[:-1], y) == (len(y) - 1) // BLOCK * BLOCK

    # A budget of one sequence and a block: each request's blocks are taken from the oldest cached.
    need = -(-(max(map(len, (x, y, z))) + GREEDY.max_tokens) // BLOCK)
    per_block = BLOCK * bytes_per_token(smollm.config, kv_dtype("auto", smollm))
    short = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, kv_cache_memory=(need + 1) * per_block))
    short.generate([x], GREEDY)
    short.generate([y], GREEDY)
    sz = short.generate([z], GREEDY)[0]
    assert sz.output_ids == fresh.generate([z], GREEDY)[0].output_ids
    again = short.generate([x], GREEDY)[0]  # x's own blocks went first: only the shared template is found
    assert again.num_cached_prompt == max(reusable(y, x), reusable(z, x)) < reusable(sx.tokens, x)
    assert again.output_ids == sx.output_ids


def test_running_sequence_shares_its_prefix_with_a_newcomer(smollm):
    """Agents fanned out with one long system prompt: the second references what the first computed."""
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
    assert sb.num_cached_prompt == reusable(a, b) > 100
    ref = fresh.generate([a, b], GREEDY)
    assert [sa.output_ids, sb.output_ids] == [r.output_ids for r in ref]
