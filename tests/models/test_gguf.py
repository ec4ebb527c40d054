"""GGUF files written by the tests with the gguf package's writer, read back by wafer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tests.tiny import Q, gguf_reader, hf_from_gguf, hf_to_gguf, make_hf_model
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams
from wafer.models.gguf_loader import permute_rope, unpermute_rope
from wafer.models.loader import load_model

PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 19556, 905, 28, 2451, 99, 2003, 17, 355, 711, 12, 60, 61]]


def greedy(loaded, n: int = 24) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(max_running=4, max_model_len=256))
    return [s.output_ids for s in engine.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_matches_safetensors_twin(tmp_path, arch):
    d = make_hf_model(tmp_path / "hf", arch)
    g = hf_to_gguf(d, tmp_path / "m.gguf", Q.F32)
    st, gg = load_model(str(d)), load_model(str(g))
    assert greedy(st) == greedy(gg)
    assert gg.config.attention_bias == (arch == "qwen2")


def test_permutation_round_trips():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rope(permute_rope(w, 4), 4), w)
    assert not torch.equal(permute_rope(w, 4), w)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("q"), "llama", seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory):
    """tiny_hf written as GGUF of one quant type, once per type for the tests below (the writer is
    deterministic: the same model, qtype and seed give the same file), as a function of the type."""
    out = tmp_path_factory.mktemp("q-gguf")
    files = {}

    def get(qtype):
        if qtype not in files:
            files[qtype] = hf_to_gguf(tiny_hf, out / f"m-{qtype.name}.gguf", qtype)
        return files[qtype]

    return get


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_quantised_weights_load_as_the_file_says(tiny_gguf, qtype):
    """Each weight wafer builds equals the library's dequantisation of the stored blocks, after
    the name mapping, the Q/K un-permutation and the QKV and gate/up fusion."""
    path = tiny_gguf(qtype)
    loaded = load_model(str(path))
    assert loaded.config.quantization == qtype.name
    reader = gguf_reader(path)
    t = {x.name: x for x in reader.tensors}

    def deq(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(dequantize(t[name].data, t[name].tensor_type), dtype=np.float32))

    cfg = loaded.config
    layer = loaded.model.layers[1]
    q = unpermute_rope(deq("blk.1.attn_q.weight"), cfg.num_heads)
    k = unpermute_rope(deq("blk.1.attn_k.weight"), cfg.num_kv_heads)
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, deq("blk.1.attn_v.weight")]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([deq("blk.1.ffn_gate.weight"), deq("blk.1.ffn_up.weight")]))
    assert torch.equal(layer.mlp.down_proj.weight, deq("blk.1.ffn_down.weight"))
    assert torch.equal(loaded.model.lm_head.weight, deq("output.weight"))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_quantised_gguf_logits_match_transformers(tiny_gguf, qtype):
    """transformers dequantises GGUF with its own code: an independent check of the whole path."""
    path = tiny_gguf(qtype)
    hf = hf_from_gguf(path)
    loaded = load_model(str(path))
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        ref = hf(ids).logits[0, -1]
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=64))
    seq = engine.add(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    engine.step()
    ours = torch.log_softmax(ref, -1)[seq.output_ids[0]]
    assert seq.output_ids[0] == int(ref.argmax())
    assert abs(seq.logprobs[0].logprob - float(ours)) < 1e-3


def test_tied_output_weights(tmp_path):
    d = make_hf_model(tmp_path / "hf", "llama", tie_word_embeddings=True)
    g = hf_to_gguf(d, tmp_path / "tied.gguf", Q.F32)
    loaded = load_model(str(g))
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    assert greedy(loaded) == greedy(load_model(str(d)))
