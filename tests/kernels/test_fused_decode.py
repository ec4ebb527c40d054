"""The C++ decode step (q4 path), in every kernel variant this CPU runs, against the Python model: same logits
up to the noise that int8 activations make of float rounding (a 1e-6 change of the embeddings moves
the logits as much), on the bundled model and on tiny models with a sliding window and QKV bias."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.test_quant import TOLERANCE_NATS
from tests.steps import advance, decode_items, prefill
from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.kernels.build import load, runnable
from wafer.kernels.fused_decode import FusedDecode
from wafer.models.loader import load_model

VARIANTS = [v.name for v in runnable()]
# Each of the two carries quantisation noise of the kind tests/models/test_quant.py bounds (std at
# most NOISE_SIGMA, from the 2% perplexity budget); the two noises are independent (perturbing the
# embeddings by 1e-6 moves the Python path's logits as much as the fused step differs), so their
# difference has sqrt(2) times that std, and the same 4.4 sigma. (Measured here: up to 0.41.)
NATS = math.sqrt(2) * TOLERANCE_NATS  # 1.24


def decode_logits(loaded, prompts: list[list[int]], steps: int, variant: str,
                  kv_dtype: torch.dtype = torch.float32, max_len: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill the prompts, then decode them together; at each step the fused (in `variant`) and
    the Python logits."""
    kv = KVCache(loaded.config, len(prompts), max_len, dtype=kv_dtype)
    runner = ModelRunner(loaded.model, kv)
    assert runner.fused is not None  # the active variant's
    runner.fused = FusedDecode.build(loaded.model, kv.layers, kv.blocks.layer_group, load(variant))
    seqs = prefill(runner, kv, prompts)
    out = []
    for _ in range(steps):
        items = decode_items(seqs)
        fused_runner = runner.fused
        runner.fused = None
        python = runner.run(items)
        runner.fused = fused_runner
        fused = runner.run(items)  # rewrites the same KV entries
        out.append((fused, python))
        advance(seqs, fused)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_bundled_model_fused_step_matches_python(smollm, variant):
    q4 = load_model(compute="q4")
    prompts = [q4.tokenizer.encode(q4.chat_template.render([{"role": "user", "content": q}]),
                                   add_special_tokens=False)
               for q in ("What is the capital of France?", "Write a haiku about snow.", "List three primes.")]
    for fused, python in decode_logits(q4, prompts, 6, variant):
        for f, p in zip(fused.log_softmax(-1), python.log_softmax(-1)):
            top = p.topk(10).indices
            assert (f[top] - p[top]).abs().max() < NATS
            assert p[int(f.argmax())] >= p.max() - NATS


@pytest.mark.parametrize("arch,kw", [("mistral", {"sliding_window": 8}), ("qwen2", {}), ("llama", {}),
                                     ("llama", {"hidden_size": 96, "intermediate_size": 192})])  # head size 24
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_models_fused_step_matches_python(tmp_path, arch, kw, variant):
    from tests.tiny import make_hf_model

    loaded = load_model(str(make_hf_model(tmp_path, arch, seed=3, **kw)), compute="q4")
    prompts = [[1, 5, 9, 13, 200, 7, 7, 42, 300, 12, 14, 15], [1, 88, 77]]
    assert_steps_agree(decode_logits(loaded, prompts, 14, variant))  # past the window of 8


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_context_fused_step_matches_python(tmp_path, variant):
    """A sequence of ~2,100 positions beside a short one: the C++ step's attention over many blocks
    (each prefetched while the one before is read) gives the Python model's logits."""
    from tests.tiny import make_hf_model

    loaded = load_model(str(make_hf_model(tmp_path, "llama", seed=3, max_position_embeddings=4096)), compute="q4")
    g = torch.Generator().manual_seed(7)
    long = [1] + torch.randint(3, 49152, (2100,), generator=g).tolist()
    assert_steps_agree(decode_logits(loaded, [long, [1, 88, 77]], 6, variant, max_len=2200))


def assert_steps_agree(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Most steps agree to float rounding; in a few, one activation rounds to the next int8 code in
    one path and not the other, which moves these random models' logits by up to ~2.5% of their
    largest (measured: 0.244 of 10.7). A wrong window or position moves them by 20% or more."""
    close = 0
    for fused, python in steps:
        scale = python.abs().max()
        assert (fused - python).abs().max() < 0.05 * scale
        close += bool((fused - python).abs().max() < 1e-4 * scale)
    assert close >= len(steps) // 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_step_is_batch_invariant(smollm, variant):
    """Each row's arithmetic in the fused step (activation quantisation, the kernels' per-row
    accumulation, its own attention) does not depend on the other rows: a sequence decoded in a
    batch gets bitwise the logits it gets alone."""
    q4 = load_model(compute="q4")
    prompts = [q4.tokenizer.encode(q4.chat_template.render([{"role": "user", "content": q}]),
                                   add_special_tokens=False)
               for q in ("What is 2+2?", "Name a colour.", "Say hello in French.", "Count to five.")]
    kv = KVCache(q4.config, len(prompts), 256)
    runner = ModelRunner(q4.model, kv)
    runner.fused = FusedDecode.build(q4.model, kv.layers, kv.blocks.layer_group, load(variant))
    seqs = prefill(runner, kv, prompts)
    for _ in range(3):
        items = decode_items(seqs)
        together = runner.run(items)
        for item, row in zip(items, together):
            assert torch.equal(runner.run([item])[0], row)  # rewrites the same KV entries
        advance(seqs, together)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("arch,kw", [("mistral", {"sliding_window": 8}),
                                     ("llama", {"hidden_size": 96, "intermediate_size": 192})])  # head size 24
@pytest.mark.parametrize("variant", VARIANTS)
def test_low_precision_kv_in_the_fused_step_matches_python(tmp_path, arch, kw, variant, kv_dtype):
    """bfloat16 and int8 rows (with their scales) are written and read alike by both paths."""
    from tests.tiny import make_hf_model

    loaded = load_model(str(make_hf_model(tmp_path, arch, seed=3, **kw)), compute="q4")
    prompts = [[1, 5, 9, 13, 200, 7, 7, 42, 300, 12, 14, 15], [1, 88, 77]]
    steps = decode_logits(loaded, prompts, 12, variant, kv_dtype)
    assert_steps_agree(steps)
    # And the rounding is real: the same model on a float32 cache gives other logits.
    exact = decode_logits(loaded, prompts, 12, variant)
    scale = steps[-1][1].abs().max()
    assert max((f - e).abs().max() for (f, _), (e, _) in zip(steps, exact)) > 1e-4 * scale


@pytest.fixture(scope="module")
def six_heads_a_kv_head(tmp_path_factory):
    """Tiny models of head size 64 with 6 query heads a KV head (more than one pass of the step's 4),
    one of them with a sliding window of 300 positions."""
    from tests.tiny import make_hf_model

    kw = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=2048)
    return {arch: load_model(str(make_hf_model(tmp_path_factory.mktemp(arch), arch, seed=4, **extra, **kw)), compute="q4")
            for arch, extra in (("llama", {}), ("mistral", {"sliding_window": 300}))}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_token_gets_the_same_logits_in_a_run_of_its_sequence_as_alone(six_heads_a_kv_head, arch, variant, kv_dtype):
    """A prompt chunk or a draft to verify is a run of one sequence's consecutive tokens, all of
    whose keys are written before any attends. Each token's arithmetic stays its own: every row's
    logits are bitwise those of its token computed alone, beside another sequence or not, at short
    and long contexts, with the window cutting into the run's context or not. (What speculation's
    identical output and chunked prefill's identical KV rest on.)"""
    from wafer.engine.scheduler import ScheduledSeq
    from wafer.engine.sequence import SamplingParams, Sequence

    loaded = six_heads_a_kv_head[arch]
    kv = KVCache(loaded.config, 2, 1100, dtype=kv_dtype)
    runner = ModelRunner(loaded.model, kv)
    runner.fused = FusedDecode.build(loaded.model, kv.layers, kv.blocks.layer_group, load(variant))
    g = torch.Generator().manual_seed(11)
    seq = Sequence([1] + torch.randint(3, 49152, (1050,), generator=g).tolist(), SamplingParams())
    other = Sequence([1, 88, 77, 5], SamplingParams())
    seq.slot, _ = kv.blocks.allocate()
    other.slot, _ = kv.blocks.allocate()
    runner.run([ScheduledSeq(seq, 0, 600)])
    runner.run([ScheduledSeq(other, 0, 3)])
    for start, count in ((20, 9), (250, 12), (600, 9), (620, 30)):
        run = runner.run([ScheduledSeq(seq, start, count)], all_logits=True)
        beside = runner.run([ScheduledSeq(other, 3, 1), ScheduledSeq(seq, start, count)], all_logits=True)[1:]
        assert torch.equal(run, beside)
        for i in range(count):
            alone = runner.run([ScheduledSeq(seq, start + i, 1)], all_logits=True)[0]
            assert torch.equal(alone, run[i]), (start, i)


def test_a_step_outside_the_caches_is_refused_before_it_computes():
    """The layers are checked once when the step is made; each step's own inputs are checked on
    every call, since a wrong table or position would read or write outside the KV pools."""
    q4 = load_model(compute="q4")
    kv = KVCache(q4.config, 2, 64)
    fused = FusedDecode.build(q4.model, kv.layers, kv.blocks.layer_group)
    assert fused is not None
    ids, pos, slots, rows = torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([0, 1])
    tables = torch.zeros(1, 2, kv.blocks.tables.shape[-1], dtype=torch.long)  # both slots on block 0
    assert fused(ids, pos, slots, tables, rows).shape == (2, q4.config.vocab_size)
    bad = tables.clone()
    bad[0, 1, 0] = kv.layers[0][0].shape[1]  # one past the pool's last block
    cases = [
        ((ids, pos, slots, bad, rows), "a table names a block outside the pools"),
        ((ids, pos, torch.tensor([0, 2]), tables, rows), "outside the tables"),
        ((ids, torch.tensor([0, -1]), slots, tables, rows), "outside the tables"),
        ((ids, pos, slots, tables, torch.tensor([0, 2])), "logit_rows: a row of x"),
        ((ids, pos, slots, tables[:, :, :0], rows), "outside the tables"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fused(*args)
