"""Compute paths against the float32 reference, within each path's documented tolerance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.steps import decode_items, prefill
from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.errors import ModelLoadError
from wafer.kernels.build import kernels
from wafer.models.loader import load_model
from wafer.models.quant import HEAD_BITS, BlockLinear, Int8Linear, apply_compute_path, resolve

QUESTIONS = ["What is the capital of France?", "Write a haiku about snow.", "Explain photosynthesis briefly.",
             "List three prime numbers.", "Who wrote Hamlet?"]
# Tolerances from the quality contract, not from a measurement: every path's perplexity within 2%
# of float32's (tests/models/test_quality.py), i.e. at most ln(1.02) nats of extra loss per token.
# Quantisation (weights and int8 activations rounded to nearest) adds zero-mean noise d to the
# next-token log-probs, and the expected extra loss of a step is KL(p_ref || p_path) ~ Var_p(d) / 2:
# so a path within budget has KL <= ln(1.02) on average and noise of std at most
# sqrt(2 ln 1.02) = 0.199 nats on the tokens that carry the probability. The largest of the 50
# top-10 differences (5 prompts) of such noise passes 4.4 sigma with probability 5e-4, hence the
# bound. (Measured here, for scale: KL 0.001 to 0.01, top-10 differences up to 0.32.)
PPL_BUDGET = 1.02
NOISE_SIGMA = math.sqrt(2 * math.log(PPL_BUDGET))
TOLERANCE_NATS = 4.4 * NOISE_SIGMA  # 0.88


def test_int8_linear_close_to_dense_and_exact_for_large_batches():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    q = Int8Linear(lin)
    x = torch.randn(4, 256)
    ref = F.linear(x, lin.weight, lin.bias)
    err = (q(x) - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.02  # quantised (not a copy of the dense path), but close
    big = torch.randn(64, 256)
    assert torch.equal(q(big), F.linear(big, lin.weight, lin.bias))  # prefill-sized batches stay float32


@pytest.fixture(scope="module", params=["int8", "q8", "q4"])
def quant_model(request):
    loaded = load_model(compute=request.param)
    # wafer's kernels build on every CPU (a portable variant at worst): q4 and q8 must run on them
    assert loaded.compute == request.param, loaded.warning
    return loaded


def last_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    kv = KVCache(loaded.config, 1, 256)
    runner = ModelRunner(loaded.model, kv)
    seqs = prefill(runner, kv, [ids])
    return torch.log_softmax(runner.run(decode_items(seqs))[0], -1)  # a decode step


def test_path_within_tolerance(smollm_f32, quant_model):
    smollm = smollm_f32
    kind = {"int8": Int8Linear, "q8": BlockLinear, "q4": BlockLinear}[quant_model.compute]
    assert any(isinstance(m, kind) for m in quant_model.model.modules())
    if quant_model.compute != "int8":
        bits = {m.fmt for m in quant_model.model.modules() if isinstance(m, BlockLinear)}
        assert bits == ({8} if quant_model.compute == "q8" else {4, HEAD_BITS})
    tol = TOLERANCE_NATS
    kls = []
    for q in QUESTIONS:
        ids = smollm.tokenizer.encode(smollm.chat_template.render([{"role": "user", "content": q}]),
                                      add_special_tokens=False)
        ref, got = last_logprobs(smollm, ids), last_logprobs(quant_model, ids)
        top = ref.topk(10).indices
        assert (ref[top] - got[top]).abs().max() < tol
        # Greedy may only pick differently among tokens the reference itself rates within tolerance.
        assert ref[int(got.argmax())] >= ref.max() - tol
        kls.append(float((ref.exp() * (ref - got)).sum()))
    assert sum(kls) / len(kls) <= math.log(PPL_BUDGET), kls  # the expected extra loss of a step


def test_unknown_path_refused():
    with pytest.raises(ValueError, match="unknown compute path"):
        resolve("fp4")
    with pytest.raises(ModelLoadError, match="unknown compute path"):
        load_model(compute="fp4")
    with pytest.raises(ValueError, match="unknown compute path"):
        apply_compute_path(nn.Linear(2, 2), "fp4")


def test_auto_runs_the_files_own_weights_per_device():
    assert kernels() is not None  # set-up builds them on every CPU, or fails
    assert resolve("auto", "cpu", "Q4_1") == "q4"
    assert resolve("auto", "cpu", "Q4_K") == "q4"
    assert resolve("auto", "cpu", "Q8_0") == "q8"
    assert resolve("auto", "cpu", "bfloat16") == "f32"  # float checkpoints are not quantised unasked
    assert resolve("auto", "cuda", "Q4_1") == "bf16"
    assert resolve("f32", "cuda") == "f32"
    with pytest.raises(ValueError, match="does not run on cuda"):
        resolve("q4", "cuda")
    with pytest.raises(ValueError, match="does not run on cpu"):
        resolve("bf16", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cuda_refused_clearly_without_a_gpu():
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(device="cuda")
