"""GGUF blocks read into wafer's records (gguf_blocks.py) against gguf-py's own dequantisation.

Random bytes are valid blocks of every type once their float16 scales are made finite, so each type
is checked on many blocks, including ones no quantiser would write (every code, every scale)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from wafer.models import blockquant as bq
from wafer.kernels.build import load, runnable
from wafer.models.gguf_blocks import (
    AS_FLOAT,
    K4,
    K6,
    GGUFEmbedding,
    bits_for,
    dequantize_f32,
    format_for,
    pack_records,
    record_inputs,
    record_parts,
)

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


@pytest.mark.parametrize("qtype", AS_FLOAT)
def test_float32_dequantisation_is_bitwise_gguf_pys(qtype):
    """The f32 path's own dequantisation against gguf-py's, bit for bit, over more rows than one
    chunk, with random codes and scale bytes."""
    raw = random_blocks(qtype, rows=300)
    ours = dequantize_f32(raw, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (300, K)
    assert torch.equal(ours.view(torch.int32), reference(raw, qtype).view(torch.int32))


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


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1])  # Q5_1: gguf-py's path, not dequantize_f32
def test_embedding_rows_dequantised_on_lookup(qtype):
    raw = random_blocks(qtype, rows=64)
    emb = GGUFEmbedding(raw, qtype, K)
    ids = torch.tensor([[3, 0, 63], [5, 5, 7]])
    got = emb(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 3, K)
    assert torch.equal(got, reference(raw, qtype)[ids])
    assert emb(torch.tensor([], dtype=torch.long)).shape == (0, K)


def k_values(parts: tuple[torch.Tensor, ...], fmt: int) -> torch.Tensor:
    """The weights that K4 or K6 inputs stand for, from the formats' definitions."""
    if fmt == K4:
        codes, sc, mn, d, dmin = parts
        per32 = d.float().repeat_interleave(8, 1) * sc.float()
        return (codes.float().view(ROWS, -1, 32) * per32[..., None]).view(ROWS, K) - \
            (dmin.float().repeat_interleave(8, 1) * mn.float()).repeat_interleave(32, 1)
    codes, sc, d = parts
    return d.float().repeat_interleave(256, 1) * sc.float().repeat_interleave(16, 1) * (codes.float() - 32)


@pytest.mark.parametrize("qtype, fmt", [(T.Q4_K, K4), (T.Q6_K, K6)])
def test_k_quants_are_held_exactly_in_records_of_their_own(qtype, fmt):
    raw = random_blocks(qtype)
    parts = record_parts(raw, qtype, K, fmt)
    assert int(parts[0].max()) == (15 if fmt == K4 else 63)
    assert torch.equal(k_values(parts, fmt), reference(raw, qtype))
    packed = pack_records(parts, fmt)
    per_weight = packed.numel() * 8 / (ROWS * K)
    assert packed.shape[:2] == (ROWS // 16, K // 256)
    assert per_weight == (4.625 if fmt == K4 else 6.5625)  # the file's own 4.5 and 6.5625, and 2 factors a group
    assert format_for([qtype], "q4") == fmt == format_for([qtype], "q8") == format_for([qtype], "q4", head=True)
    assert format_for([T.Q4_K, T.Q6_K], "q4") == 8


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1])
def test_five_bit_records_hold_the_files_weights(qtype):
    """5-bit types go into 5-bit records as they are (6 bits a weight); 4-bit ones may share them."""
    from wafer.kernels.build import kernels

    raw = random_blocks(qtype)
    codes, d, m = record_inputs(raw, qtype, K, 5)
    assert int(codes.max()) == (31 if qtype in (T.Q5_0, T.Q5_1) else 15)
    assert torch.equal(values(codes, d, m), reference(raw, qtype))
    packed = pack_records((codes, d, m), 5)
    assert packed.numel() * 8 / (ROWS * K) == 6.0
    assert format_for([T.Q5_0, T.Q5_0, T.Q4_1], "q8") == 5 == format_for([T.Q5_1], "q4", head=True)
    assert format_for([T.Q5_0, T.Q8_0], "q4") == 8 and format_for([T.Q4_1], "q8") == 8 and format_for([T.Q4_1], "q4") == 4
    kern = kernels()
    if kern is None:
        pytest.skip("wafer's kernels are not built here")
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 9)[:, None]
    got = kern.block_linear(x, packed, ROWS).double()
    want = bq.quantize_activations(x).double() @ reference(raw, qtype).double().T
    assert ((got - want).abs().amax(1) / want.abs().amax(1) < 1e-5).all()


@pytest.mark.parametrize("qtype, fmt", [(T.Q4_K, K4), (T.Q6_K, K6)])
def test_k_records_through_the_kernel_equal_the_files_weights(qtype, fmt):
    """block_linear on the records against the activations' int8 blocks times gguf-py's weights."""
    from wafer.kernels.build import kernels

    kern = kernels()
    if kern is None:
        pytest.skip("wafer's kernels are not built here")
    raw = random_blocks(qtype, rows=40, seed=3)  # 40 rows: the last group of 16 padded
    packed = pack_records(record_parts(raw, qtype, K, fmt), fmt)
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 11)[:, None]
    got = kern.block_linear(x, packed, 40).double()
    want = bq.quantize_activations(x).double() @ reference(raw, qtype).double().T
    err = (got - want).abs().amax(1) / want.abs().amax(1)
    assert (err < 1e-5).all(), err


@pytest.mark.parametrize("variant", [v.name for v in runnable()])
def test_q8_0_embedding_rows_in_the_kernels_are_gguf_pys(variant):
    """The lookup of SmolLM2's and Gemma 3's Q8_0 tables, in each variant: bitwise gguf-py's rows,
    subnormal and negative scales included; an id outside the table is refused, not read."""
    k = load(variant)
    raw = random_blocks(T.Q8_0, rows=64)
    raw[5, :2].view(torch.int16).fill_(0x0001)  # the smallest subnormal scale
    raw[7, 3 * 34 : 3 * 34 + 2].view(torch.int16).fill_(-0x4000)  # -2.0
    ids = torch.tensor([3, 0, 63, 5, 5, 7])
    assert torch.equal(k.embed_q8_0(raw, ids), reference(raw, T.Q8_0)[ids])
    assert k.embed_q8_0(raw, torch.tensor([], dtype=torch.long)).shape == (0, K)
    for bad in (64, -1):
        with pytest.raises(RuntimeError, match="a row of the table"):
            k.embed_q8_0(raw, torch.tensor([1, bad]))
    with pytest.raises(RuntimeError, match="whole Q8_0 blocks"):
        k.embed_q8_0(raw[:, :-1], ids)
