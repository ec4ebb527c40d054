"""Decode steps over static shapes, as CUDA graphs replay them: on the CPU the same forward runs
eagerly and must equal the ordinary path (padding included); on a GPU the captured graphs must
equal eager execution. CI has no GPU: the capture test is skipped there."""

from __future__ import annotations

import pytest
import torch

from tests.steps import advance, decode_items, prefill
from wafer.engine.cuda_graph import GraphedDecode, buckets, length_buckets
from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.models.loader import load_model

PROMPTS = [[1, 5, 9, 13, 200, 7, 7, 42, 300, 12, 14, 15], [1, 88, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 3]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 64]
    for n in range(1, 65):
        assert any(b >= n for b in buckets(64))
    assert length_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert length_buckets(300) == [256, 300]
    assert length_buckets(64) == [64]


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("mistral", {"sliding_window": 8})])
def test_static_decode_equals_the_ordinary_path(tmp_path, arch, kw):
    from tests.tiny import make_hf_model

    loaded = load_model(str(make_hf_model(tmp_path, arch, seed=5, **kw)))
    kv = KVCache.for_model(loaded.model, 4, 64)
    runner = ModelRunner(loaded.model, kv)
    # Context buckets of 16, 32 and 64 positions: the sequences cross from the first to the second.
    static = GraphedDecode(loaded.model, kv, 4, capture=False, min_length=16)
    assert static.lengths == [16, 32, 64]
    seqs = prefill(runner, kv, PROMPTS)
    for _ in range(12):  # past the window of 8
        ordinary = runner.run(decode_items(seqs))
        # Three sequences in the bucket of 4: the padding row rewrites the first one's key and value.
        got = static([s.tokens[s.num_cached] for s in seqs], [s.num_cached for s in seqs], [s.slot for s in seqs])
        assert got.shape == ordinary.shape
        torch.testing.assert_close(got, ordinary, rtol=1e-4, atol=1e-4)
        advance(seqs, ordinary)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA graphs cannot be captured here")
def test_captured_graphs_equal_eager_on_cuda(tmp_path):
    from tests.tiny import make_hf_model

    path = str(make_hf_model(tmp_path, "llama", seed=5))
    loaded = load_model(path, compute="bf16", device="cuda")
    kv = KVCache.for_model(loaded.model, 4, 64)
    runner = ModelRunner(loaded.model, kv)  # captures graphs for 1, 2 and 4 sequences
    assert runner.graphed is not None and runner.graphed.graphs
    eager = GraphedDecode(loaded.model, kv, 4, capture=False)
    seqs = prefill(runner, kv, PROMPTS)
    for _ in range(6):
        args = ([s.tokens[s.num_cached] for s in seqs], [s.num_cached for s in seqs], [s.slot for s in seqs])
        replayed = runner.run(decode_items(seqs))
        torch.testing.assert_close(replayed, eager(*args).cpu(), rtol=2e-2, atol=2e-2)
        advance(seqs, replayed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_engine_on_cuda_gives_the_cpu_greedy_tokens(tmp_path):
    """The whole engine on the GPU (scheduler, chunked prefill, graph replay, host-side sampling) in
    float32, against the same engine on the CPU: float32 on both sides, so greedy tokens must agree."""
    from tests.tiny import make_hf_model
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    path = str(make_hf_model(tmp_path, "llama", seed=5))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(path, compute="f32", device=device)
        engine = LLMEngine(loaded, EngineConfig(max_running=4, max_model_len=128, max_batched_tokens=8))
        assert (engine.runner.graphed is not None) == (device == "cuda")
        outputs[device] = [s.output_ids for s in engine.generate(PROMPTS, params)]
        assert engine.blocks.num_used == 0
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_fp8_kv_on_cuda_gives_the_cpu_fp8_greedy_tokens(tmp_path):
    """fp8 KV (e4m3 codes and a scale per position and head) through the GPU's engine, graphs
    included, against the same rows written and read on the CPU's Python path: float32 arithmetic on
    both sides around the same rounding, so greedy tokens agree."""
    from tests.tiny import make_hf_model
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    path = str(make_hf_model(tmp_path, "llama", seed=5))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(path, compute="f32", device=device)
        engine = LLMEngine(loaded, EngineConfig(max_running=4, max_model_len=128, max_batched_tokens=8,
                                                kv_cache_dtype="fp8"))
        assert engine.kv.layers[0][0].dtype == torch.float8_e4m3fn
        outputs[device] = [s.output_ids for s in engine.generate(PROMPTS, params)]
    assert outputs["cuda"] == outputs["cpu"]
