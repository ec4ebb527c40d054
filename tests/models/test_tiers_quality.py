"""The two Qwen2.5-Coder tiers' default compute path within 2% of float32 perplexity on held text.

terra is held against an independent reference, transformers on the same GGUF in float32: its
default path's perplexity against transformers', and wafer's float32 greedy output equal to
transformers' for held prompts (each greedy token is transformers' argmax after the prompt and the
tokens before it, found in one forward pass over the whole text: what greedy decoding is, without
transformers' per-token overhead). sol is terra's architecture and loader at three times the size,
so its float32 reference is wafer's own (as test_quality.py holds SmolLM2): transformers' load of
its GGUF alone took a minute to a minute and a half of a 2-core machine, and wafer's float32
perplexity here equalled transformers' to every printed digit (6.106212543926638, 512 tokens)."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from bench.quality import corpus_ids, perplexity
from tests.tiny import hf_from_gguf
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams
from wafer.models import catalog
from wafer.models.loader import load_model

pytestmark = pytest.mark.heavy

PROMPTS = ["Write a Python function that reverses a singly linked list.",
           "Explain what `git rebase -i HEAD~3` does, briefly."]
NEW_TOKENS = 24
PPL_TOKENS = 512


def greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(max_running=2, max_model_len=512))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    return [s.output_ids for s in seqs]


def reference_perplexity(hf, ids: list[int]) -> float:
    """transformers' perplexity over one window, as bench.quality.perplexity counts it."""
    logits = hf(torch.tensor([ids])).logits[0, :-1]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).view(-1, 1)).sum()
    return math.exp(float(nll) / (len(ids) - 1))


def installed(tier: str):
    model = catalog.find(tier)
    path = catalog.installed_path(model)
    if path is None:
        pytest.skip(f"{model.name} is not installed (`wafer models install`, which `make test` runs)")
    return path


def default_path_perplexity(path) -> tuple[float, list[int], object]:
    fast = load_model(str(path), compute="auto")
    assert fast.compute in ("q4", "q8")
    ids = corpus_ids(fast.tokenizer, PPL_TOKENS)
    return perplexity(fast, ids, PPL_TOKENS, PPL_TOKENS), ids, fast


def test_terra_default_path_perplexity_within_two_percent_and_float32_greedy_equals_transformers():
    path = installed("terra")
    ppl, ids, fast = default_path_perplexity(path)
    prompts = [fast.tokenizer.encode(fast.chat_template.render([{"role": "user", "content": p}]),
                                     add_special_tokens=False) for p in PROMPTS]
    del fast
    f32 = load_model(str(path), compute="f32")
    ours = greedy(f32, prompts)
    del f32
    gc.collect()

    hf = hf_from_gguf(path)
    try:
        with torch.inference_mode():
            for prompt, mine in zip(prompts, ours):
                assert len(mine) == NEW_TOKENS and len(set(mine)) > 8  # real text, not one token repeated
                logits = hf(torch.tensor([prompt + mine]), logits_to_keep=NEW_TOKENS + 1).logits[0, :-1]
                assert mine == logits.argmax(-1).tolist()
            ref_ppl = reference_perplexity(hf, ids)
    finally:
        del hf
        gc.collect()
    assert 1 < ref_ppl < 30  # the reference is sane for a code model on English prose
    assert ppl <= 1.02 * ref_ppl, ("terra", ppl, ref_ppl)


def test_sol_default_path_perplexity_within_two_percent_of_float32():
    path = installed("sol")
    ppl, ids, fast = default_path_perplexity(path)
    del fast
    gc.collect()
    f32 = load_model(str(path), compute="f32")
    ref_ppl = perplexity(f32, ids, PPL_TOKENS, PPL_TOKENS)
    del f32
    gc.collect()
    assert 1 < ref_ppl < 30
    assert ppl <= 1.02 * ref_ppl, ("sol", ppl, ref_ppl)
