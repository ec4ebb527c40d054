"""How much prompt a step takes while others decode."""

from __future__ import annotations

from wafer.engine.engine import EngineConfig, LLMEngine
from wafer.engine.sequence import SamplingParams


def _prompt_tokens_per_step(engine: LLMEngine, long_prompt: list[int]) -> list[int]:
    """Start one sequence decoding, then add a long prompt; the prompt tokens of each step until it is in."""
    engine.add([1, 2, 3, 4], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    engine.step()  # its prefill; it decodes from now on
    seq = engine.add(long_prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    counts = []
    while seq.num_cached < len(long_prompt) - 1 and not seq.finished:
        before = seq.num_cached
        engine.step()
        counts.append(seq.num_cached - before)
    return counts


def test_a_long_prompt_is_read_in_steps_of_bounded_time(smollm):
    long_prompt = list(range(100, 400))
    engine = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=512, max_batched_tokens=256,
                                            prefix_caching=False, prefill_step_seconds=0.02))
    engine._seconds_per_token = 0.001  # as if learned: 20 prompt tokens fit in the step's 20 ms
    counts = _prompt_tokens_per_step(engine, long_prompt)
    assert max(counts[:-1]) <= 20 and max(counts) <= 20, counts

    free = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=512, max_batched_tokens=256,
                                          prefix_caching=False))
    assert max(_prompt_tokens_per_step(free, long_prompt)) == 256 - 1  # the whole budget but the decoder's


def test_the_cost_of_a_token_is_learned_from_prompt_steps(smollm):
    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, prefill_step_seconds=0.05))
    assert engine._prefill_cap() is None  # nothing measured yet: no cap
    engine.generate([list(range(100, 300))], SamplingParams(max_tokens=2, temperature=0))
    assert engine._seconds_per_token is not None and 0 < engine._seconds_per_token < 0.05
    assert engine._prefill_cap() >= 16
