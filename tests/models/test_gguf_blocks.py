"""GGUF blocks read into wafer's records (gguf_blocks.py) against gguf-py's own dequantisation.

Random bytes are valid blocks of every type once their float16 scales are made finite, so each type
is checked on many blocks, including ones no quantiser would write (every code, every scale)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from wafer.models.gguf_blocks import GGUFEmbedding, bits_for, record_inputs

K = 512  # two K-quant blocks, sixteen 32-blocks per row
ROWS = 48

# Byte offsets of each type's float16 scales within a block.
SCALES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
          T.Q6_K: [208]}


def random_blocks(qtype: T, rows: int = ROWS, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = g.integers(0, 256, size=(rows, K // block, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        d = g.uniform(1e-3, 2e-2, size=(rows, K // block)).astype(np.float16)
        if off == 2:
            d = d / 4  # the minimum's scale, smaller as in real files
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, K // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference(raw: torch.Tensor, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw.numpy(), qtype), dtype=np.float32).reshape(raw.shape[0], K))


def values(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    return (codes.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None]).view(n, -1)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
@pytest.mark.parametrize("bits", [4, 8])
def test_legacy_blocks_are_held_exactly(qtype, bits):
    raw = random_blocks(qtype)
    codes, d, m = record_inputs(raw, qtype, K, bits)
    assert codes.shape == (ROWS, K) and d.shape == m.shape == (ROWS, K // 32)
    if bits == 4 and qtype not in (T.Q4_0, T.Q4_1):  # wider types are quantised again to 4 bits
        assert int(codes.max()) <= 15
        err = (values(codes, d, m) - reference(raw, qtype)).abs().max()
        assert err > 0  # lossy, and so not what the 8-bit records do
        return
    assert int(codes.max()) <= (15 if bits == 4 else 255)
    assert torch.equal(values(codes, d, m), reference(raw, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K])
def test_k_blocks_are_held_to_float16_scales(qtype):
    raw = random_blocks(qtype)
    ref = reference(raw, qtype)
    bits = 4 if qtype == T.Q4_K else 8
    codes, d, m = record_inputs(raw, qtype, K, bits)
    assert int(codes.max()) == (15 if qtype == T.Q4_K else 31)
    got = values(codes, d, m)
    # Only d * sc and dmin * mn are rounded to float16 (11 significant bits): per 32-block the error
    # is at most 2^-11 of (scale * largest code + |minimum|).
    scale = d.float().abs() * codes.float().view(ROWS, -1, 32).amax(-1) + m.float().abs()
    bound = scale.repeat_interleave(32, dim=1) * 2.0**-10
    assert ((got - ref).abs() <= bound).all()
    assert (got - ref).abs().max() > 0  # the rounding is real, so the bound is what is tested


def test_q6_k_goes_to_8_bits_within_half_a_step():
    raw = random_blocks(T.Q6_K)
    ref = reference(raw, T.Q6_K)
    codes, d, m = record_inputs(raw, T.Q6_K, K, 8)
    got = values(codes, d, m)
    step = d.float().repeat_interleave(32, dim=1)
    assert ((got - ref).abs() <= 0.5 * step + 1e-7).all()
    assert bits_for(T.Q6_K, "q4") == 8 and bits_for(T.Q4_K, "q4") == 4 and bits_for(T.Q4_K, "q8") == 8


def test_embedding_rows_dequantised_on_lookup():
    raw = random_blocks(T.Q4_K, rows=64)
    emb = GGUFEmbedding(raw, T.Q4_K, K)
    ids = torch.tensor([[3, 0, 63], [5, 5, 7]])
    assert torch.equal(emb(ids), reference(raw, T.Q4_K)[ids])
