"""wafer's Llama-family model against transformers on tiny random models saved as safetensors."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_hf_model
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK
from wafer.engine.model_runner import ModelRunner
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import SamplingParams, Sequence
from wafer.models.loader import load_model

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 2451, 99, 2003, 17, 355, 711, 12]

VARIANTS = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[request.param]
    d = make_hf_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf, load_model(str(d))


def wafer_logits(loaded, prompt: list[int], steps: int) -> list[torch.Tensor]:
    kv = KVCache(loaded.config, 2, 512)
    runner = ModelRunner(loaded.model, kv)
    seq = Sequence(list(prompt), SamplingParams())
    seq.slot, _ = kv.blocks.allocate()
    out = [runner.run([ScheduledSeq(seq, 0, len(prompt))], all_logits=True)]
    for _ in range(steps):
        seq.tokens.append(int(out[-1][-1].argmax()))
        out.append(runner.run([ScheduledSeq(seq, len(seq.tokens) - 1, 1)]))
    return out


@torch.inference_mode()
def hf_logits(hf, prompt: list[int], steps: int) -> list[torch.Tensor]:
    res = hf(torch.tensor([prompt]), use_cache=True)
    out = [res.logits[0]]
    past = res.past_key_values
    for _ in range(steps):
        tok = out[-1][-1].argmax().view(1, 1)
        res = hf(tok, past_key_values=past, use_cache=True)
        past = res.past_key_values
        out.append(res.logits[0])
    return out


def test_prefill_and_decode_logits_match(pair):
    hf, loaded = pair
    ours, ref = wafer_logits(loaded, PROMPT, 32), hf_logits(hf, PROMPT, 32)
    assert ours[0].shape == ref[0].shape
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() < 1e-4


def test_greedy_64_tokens_identical(pair):
    hf, loaded = pair
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=64, do_sample=False)[0, len(PROMPT):].tolist()
    engine = LLMEngine(loaded, EngineConfig(max_running=2, max_model_len=512))
    seq = engine.generate([PROMPT], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    assert seq.output_ids == ref
    assert len(set(ref)) > 4  # the model is not stuck on one token, so the check has teeth


def test_kv_heads_not_expanded(pair):
    _, loaded = pair
    kv = KVCache(loaded.config, 3, 64)  # 3 sequences of 64 tokens: 12 blocks of 16
    assert kv.layers[0][0].shape == (loaded.config.num_kv_heads, 12, BLOCK, loaded.config.head_dim)
    assert loaded.config.num_kv_heads < loaded.config.num_heads
