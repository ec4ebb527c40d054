"""The engine on the real default model: batching, stops, seeds, logprobs, aborts."""

from __future__ import annotations

import pytest
import torch

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams

QUESTIONS = [
    "Hi",
    "What is the capital of Japan?",
    "Write a limerick about a cat who loves to code in Python every night.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "Why is the sky blue?",
    "Translate 'good morning' into French, Spanish and German.",
    "Summarise the plot of Romeo and Juliet in two sentences, then explain its main theme in detail.",
    "Count from one to ten, slowly.",
]


@pytest.fixture(scope="module")
def engine(smollm):
    return LLMEngine(smollm, EngineConfig(max_running=8, max_model_len=1024, max_batched_tokens=64))


@pytest.fixture(scope="module")
def prompts(smollm):
    return [
        smollm.tokenizer.encode(smollm.chat_template.render([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]


def test_batch_of_eight_equals_each_alone(smollm, prompts):
    """Batched prefill of fresh prompts, not one-token prefills after a prefix-cache hit: each run on
    an engine of its own with the prefix cache off, and every prompt token computed in the batch."""
    assert len({len(p) for p in prompts}) == 8
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def fresh() -> LLMEngine:
        return LLMEngine(smollm, EngineConfig(max_running=8, max_model_len=1024, max_batched_tokens=512,
                                              prefix_caching=False))

    assert sum(len(p) for p in prompts) <= 512
    batch = fresh()
    seqs = [batch.add(p, params) for p in prompts]
    assert len(batch.step()) == 8  # one step prefilled all eight whole and sampled each one's first token
    assert batch.stats.prompt_tokens == sum(len(p) for p in prompts)
    while not all(s.finished for s in seqs):
        batch.step()
    together = [s.output_ids for s in seqs]
    assert batch.kv.blocks.num_used == 0
    solo = fresh()
    alone = [solo.generate([p], params)[0].output_ids for p in prompts]
    assert together == alone


def test_chunked_prefill_matches_whole_prefill(smollm, prompts):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    small = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=1024, max_batched_tokens=7))
    big = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=1024, max_batched_tokens=4096))
    assert small.generate([prompts[6]], params)[0].output_ids == big.generate([prompts[6]], params)[0].output_ids


def test_max_tokens_and_finish_reason(engine, prompts):
    s = engine.generate([prompts[3]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(s.output_ids) == 5 and s.finish_reason == "length"
    s = engine.generate([prompts[1]], SamplingParams(max_tokens=200, temperature=0))[0]
    assert s.finish_reason == "stop" and s.output_ids[-1] in engine.tokenizer.eos_ids
    assert "Tokyo" in s.text


def test_stop_strings_cut_text_and_never_stream_it(engine, prompts):
    full = engine.generate([prompts[7]], SamplingParams(max_tokens=60, temperature=0))[0].text
    stop = full[10:14]
    seq = engine.add(prompts[7], SamplingParams(max_tokens=60, temperature=0, stop=[stop]))
    streamed = ""
    while not seq.finished:
        for out in engine.step():
            if out.seq_id == seq.seq_id:
                streamed += out.text
    assert seq.finish_reason == "stop"
    assert seq.text == full[: full.index(stop)]
    assert streamed == seq.text


def test_stop_token_ids(engine, prompts):
    full = engine.generate([prompts[7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    target = full.output_ids[6]
    s = engine.generate([prompts[7]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[target]))[0]
    assert s.output_ids == full.output_ids[: full.output_ids.index(target) + 1]
    assert s.finish_reason == "stop"


def test_same_seed_same_output_different_seed_differs(engine, prompts):
    p = lambda seed: SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)  # noqa: E731
    a = engine.generate([prompts[2]], p(7))[0].output_ids
    b = engine.generate([prompts[2]], p(7))[0].output_ids
    c = engine.generate([prompts[2]], p(8))[0].output_ids
    assert a == b and a != c
    # The seed holds inside a batch too.
    batch = engine.generate([prompts[2], prompts[4]], [p(7), p(9)])
    assert batch[0].output_ids == a


def test_logprobs_are_model_logprobs(engine, prompts, smollm):
    s = engine.generate([prompts[1]], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(s.logprobs) == 4
    for lp, tok in zip(s.logprobs, s.output_ids):
        assert lp.token_id == tok
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the chosen token is the best
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    # Against a direct forward pass of the model.
    ids = torch.tensor(prompts[1])
    from wafer.engine.kv_cache import KVCache
    from wafer.engine.model_runner import ModelRunner
    from wafer.engine.scheduler import ScheduledSeq
    from wafer.engine.sequence import Sequence

    kv = KVCache(smollm.config, 1, 256, dtype=engine.kv_dtype)  # the engine's KV, rounded alike
    seq = Sequence(ids.tolist(), SamplingParams())
    seq.slot, _ = kv.blocks.allocate()
    logits = ModelRunner(smollm.model, kv).run([ScheduledSeq(seq, 0, len(ids))])
    assert s.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-4)


def test_abort_frees_slot(engine, prompts):
    seqs = [engine.add(p, SamplingParams(max_tokens=100, temperature=0)) for p in prompts[:4]]
    engine.step()
    engine.step()
    assert engine.blocks.num_used == 4
    for s in seqs:
        engine.abort(s.seq_id)
    assert engine.blocks.num_used == 0 and not engine.has_work
    assert engine.blocks.usage == 0.0


def test_prompt_too_long_is_refused(engine):
    with pytest.raises(ValueError, match="context"):
        engine.add([1] * 2000, SamplingParams())
