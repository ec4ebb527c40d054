"""The two Qwen2.5-Coder tiers against an independent reference: greedy output of wafer's float32
path equals transformers' on the same GGUF for held prompts, and the default compute path's
perplexity on held text stays within 2% of float32's (as test_quality.py holds for SmolLM2)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from bench.quality import corpus_ids, perplexity
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


@pytest.mark.parametrize("tier", ["terra", "sol"])
def test_greedy_equals_transformers_and_default_path_perplexity_within_two_percent(tier):
    model = catalog.find(tier)
    path = catalog.installed_path(model)
    if path is None:
        pytest.skip(f"{model.name} is not installed (`wafer models install`, which `make test` runs)")
    f32 = load_model(str(path), compute="f32")
    prompts = [f32.tokenizer.encode(f32.chat_template.render([{"role": "user", "content": p}]),
                                    add_special_tokens=False) for p in PROMPTS]
    ours = greedy(f32, prompts)
    ids = corpus_ids(f32.tokenizer, PPL_TOKENS)
    ref_ppl = perplexity(f32, ids, PPL_TOKENS, PPL_TOKENS)
    del f32
    gc.collect()

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                              dtype=torch.float32).eval()
    for prompt, mine in zip(prompts, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None)[0, len(prompt):].tolist()
        assert mine == ref
        assert len(set(ref)) > 8  # real text, not one token repeated
    del hf
    gc.collect()

    fast = load_model(str(path), compute="auto")
    assert fast.compute in ("q4", "q8")
    ppl = perplexity(fast, ids, PPL_TOKENS, PPL_TOKENS)
    assert 1 < ref_ppl < 30  # the reference is sane for a code model on English prose
    assert ppl <= 1.02 * ref_ppl, (fast.compute, ppl, ref_ppl)
