"""The two Qwen2.5-Coder tiers against an independent reference: greedy output of wafer's float32
path equals transformers' on the same GGUF for held prompts (each greedy token is transformers'
argmax after the prompt and the tokens before it, found in one forward pass over the whole text:
what greedy decoding is, without transformers' per-token overhead on a 1.5B model), and the default compute path's
perplexity on held text stays within 2% of float32's (as test_quality.py holds for SmolLM2)."""

from __future__ import annotations

import gc

import pytest
import torch

from bench.quality import corpus_ids, perplexity
from tests.tiny import hf_from_gguf
from wafer.engine.engine import EngineConfig, LLMEngine
from wafer.engine.sequence import SamplingParams
from wafer.models import catalog
from wafer.models.loader import load_model

PROMPTS = ["Write a Python function that reverses a singly linked list.",
           "Explain what `git rebase -i HEAD~3` does, briefly."]
NEW_TOKENS = 24
PPL_TOKENS = 512


def greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(max_running=2, max_model_len=512))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    return [s.output_ids for s in seqs]


# sol is terra's architecture and loader at three times the size: one prompt there suffices.
@pytest.mark.parametrize("tier,n_prompts", [("terra", 2), ("sol", 1)])
def test_greedy_equals_transformers_and_default_path_perplexity_within_two_percent(tier, n_prompts):
    model = catalog.find(tier)
    path = catalog.installed_path(model)
    if path is None:
        pytest.skip(f"{model.name} is not installed (`wafer models install`, which `make test` runs)")
    f32 = load_model(str(path), compute="f32")
    prompts = [f32.tokenizer.encode(f32.chat_template.render([{"role": "user", "content": p}]),
                                    add_special_tokens=False) for p in PROMPTS[:n_prompts]]
    ours = greedy(f32, prompts)
    ids = corpus_ids(f32.tokenizer, PPL_TOKENS)
    ref_ppl = perplexity(f32, ids, PPL_TOKENS, PPL_TOKENS)
    del f32
    gc.collect()

    hf = hf_from_gguf(path)
    with torch.inference_mode():
        for prompt, mine in zip(prompts, ours):
            assert len(mine) == NEW_TOKENS and len(set(mine)) > 8  # real text, not one token repeated
            logits = hf(torch.tensor([prompt + mine]), logits_to_keep=NEW_TOKENS + 1).logits[0, :-1]
            assert mine == logits.argmax(-1).tolist()
    del hf
    gc.collect()

    fast = load_model(str(path), compute="auto")
    assert fast.compute in ("q4", "q8")
    ppl = perplexity(fast, ids, PPL_TOKENS, PPL_TOKENS)
    assert 1 < ref_ppl < 30  # the reference is sane for a code model on English prose
    assert ppl <= 1.02 * ref_ppl, (fast.compute, ppl, ref_ppl)
