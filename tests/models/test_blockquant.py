"""wafer's block-quantised kernels: the file's own Q4_1/Q8_0 codes come back from its dequantised
weights, and every kernel variant this CPU runs (wafer/kernels/build.py) equals the same arithmetic done by
PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.tiny import gguf_reader
from wafer.models import blockquant as bq
from wafer.kernels.build import load, runnable
from wafer.models.loader import default_model_path

# Every variant this CPU executes, forced one by one: an AVX-512 machine tests avx2 and portable too.
VARIANTS = [v.name for v in runnable()]


@pytest.fixture(scope="module")
def gguf_tensors():
    reader = gguf_reader(default_model_path())
    return {t.name: t for t in reader.tensors}


def test_requantising_the_gguf_gives_back_its_codes(gguf_tensors):
    t = gguf_tensors["blk.3.ffn_down.weight"]
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).float()
    codes, d, m = bq.quantize_codes(w, 4)
    assert torch.equal(bq.dequantize_codes(codes, d, m), w) or (bq.dequantize_codes(codes, d, m) - w).abs().max() < 1e-6
    # The codes are the file's: block j's nibbles as stored (2 f16 scales, then 16 bytes; element i in
    # the low nibble of byte i, i + 16 in its high one).
    raw = np.array(t.data).reshape(w.shape[0], -1, 20)[..., 4:]
    blocks = codes.reshape(w.shape[0], -1, 32)
    assert np.array_equal((blocks[..., :16] | (blocks[..., 16:] << 4)).numpy(), raw)

    e = gguf_tensors["token_embd.weight"]
    assert e.tensor_type == GGMLQuantizationType.Q8_0
    w8 = torch.from_numpy(np.array(dequantize(e.data, e.tensor_type))).float()[:4096]
    q8, d8 = bq.quantize_q8(w8)
    raw8 = np.array(e.data)[:4096].reshape(4096, -1, 34)[..., 2:].view(np.int8)
    assert np.array_equal(q8.numpy().reshape(raw8.shape), raw8)
    assert (bq.dequantize_q8(q8, d8) - w8).abs().max() < 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 576, 200), (3, 384, 48), (8, 160, 37), (11, 576, 16), (2, 64, 1),
                                             (17, 1536, 96)])
def test_kernels_equal_the_same_arithmetic_in_torch(variant, rows, k_in, n_out):
    """Output sizes that fill groups of 16 channels and that leave a partial group; batches of one
    row, of one tile of eight, of more than one tile."""
    torch.manual_seed(rows)
    k = load(variant)
    w = torch.randn(n_out, k_in) * 0.05
    x = torch.randn(rows, k_in) * 3
    xq = bq.quantize_activations(x)
    codes, d, m = bq.quantize_codes(w, 4)
    ref4 = xq @ bq.dequantize_codes(codes, d, m).T
    y4 = k.block_linear(x, bq.pack_blocks(codes, d, m, 4), n_out)
    assert y4.shape == (rows, n_out)
    assert (y4 - ref4).abs().max() < 1e-4 * ref4.abs().max()
    q8, d8 = bq.quantize_q8(w)
    ref8 = xq @ bq.dequantize_q8(q8, d8).T
    y8 = k.block_linear(x, bq.pack_q8(q8, d8), n_out)
    assert (y8 - ref8).abs().max() < 1e-4 * ref8.abs().max()
    if rows * n_out < 64:
        return  # too few outputs for the statistics below
    # And close to the float product they stand for: 4 bits of Gaussian weights leave about 8% of
    # the output's norm as error, 8 bits well under 1%.
    exact = x @ w.T
    assert torch.linalg.norm(y4 - exact) < 0.12 * torch.linalg.norm(exact)
    assert torch.linalg.norm(y8 - exact) < 0.01 * torch.linalg.norm(exact)


@pytest.mark.parametrize("variant", VARIANTS)
def test_extreme_codes_and_activations_are_exact(variant):
    """Every 8-bit code from 0 to 255 (q8's unsigned codes, which some variants turn signed) against
    activations of +-127, and 4-bit codes 0 and 15 against them: the integer sums must not saturate
    anywhere (a 16-bit pair sum would), so the kernel equals the float product to rounding."""
    k = load(variant)
    g = torch.Generator().manual_seed(1)
    n, kin = 32, 256
    codes8 = torch.arange(n * kin).remainder(256).to(torch.uint8).reshape(n, kin)
    d = torch.full((n, kin // 32), 0.01).half()
    step = float(d[0, 0])  # 0.01 as float16 holds it
    packed8 = bq.pack_blocks(codes8, d, (d.float() * -128).half(), 8)
    w8 = (codes8.float() - 128) * step
    x = torch.where(torch.rand(3, kin, generator=g) < 0.5, -1.0, 1.0) * 127  # quantises to exactly +-127
    assert torch.allclose(k.block_linear(x, packed8, n), x @ w8.T, rtol=1e-5, atol=1e-3)
    codes4 = torch.where(torch.rand(n, kin, generator=g) < 0.5, 0, 15).to(torch.uint8)
    packed4 = bq.pack_blocks(codes4, d, d, 4)
    w4 = codes4.float() * step + step
    assert torch.allclose(k.block_linear(x, packed4, n), x @ w4.T, rtol=1e-5, atol=1e-3)
    codes6 = torch.where(torch.rand(n, kin, generator=g) < 0.5, 0, 63).to(torch.uint8)
    packed6 = bq.pack_blocks(codes6, d, d, 6)
    w6 = codes6.float() * step + step
    assert torch.allclose(k.block_linear(x, packed6, n), x @ w6.T, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_every_code_of_every_width_lands_on_its_input(variant, bits):
    """Codes at random in 0..2^bits - 1, each input a channel's own, against a plain product of the
    unpacked weights: a bit of the 5- and 6-bit records' planes read for the wrong input or channel
    changes the result."""
    k = load(variant)
    g = torch.Generator().manual_seed(bits)
    n, kin = 37, 576
    codes = torch.randint(0, 1 << bits, (n, kin), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, kin // 32, generator=g) * 0.02 + 0.001).half()
    m = (torch.rand(n, kin // 32, generator=g) * 0.1 - 0.05).half()
    w = codes.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    x = torch.randn(5, kin, generator=g) * 2
    ref = bq.quantize_activations(x) @ w.T
    y = k.block_linear(x, bq.pack_blocks(codes, d, m, bits), n)
    assert (y - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
def test_argmax_rows_is_torch_max(variant):
    """Ties (the first wins), NaN (the first NaN wins), rows of -inf, lengths that leave a tail."""
    k = load(variant)
    g = torch.Generator().manual_seed(2)
    for v in (1, 15, 17, 1000, 49152):
        x = torch.randn(6, v, generator=g)
        x[1, v // 2] = x[1].max() + 1
        x[1, v - 1] = x[1, v // 2]
        x[2] = float("-inf")
        x[3, v // 3] = float("nan")
        x[3, v - 1] = float("nan")
        x[4] = 7.0
        assert k.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist(), (variant, v)


@pytest.mark.parametrize("variant", VARIANTS)
def test_top_candidates_are_torch_softmax_then_topk(variant):
    """Each row's k best at its temperature and their probabilities, as the sampler computed them with
    torch (tempered, softmax, topk): +inf wins, NaN and -inf are masked, a row with nothing left is NaN."""
    from wafer.engine.sampler import tempered

    k = load(variant)
    g = torch.Generator().manual_seed(3)
    for v in (5, 17, 1000, 151936):
        x = torch.randn(5, v, generator=g) * 4
        x[1, v // 2] = float("inf")
        x[1, 0] = float("nan")
        x[2, : v - 2] = float("-inf")
        x[3] = float("-inf")
        t = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0])
        probs, idx = k.top_candidates(x, t, 256)
        want = tempered(x, t.unsqueeze(1)).softmax(-1).topk(min(256, v), dim=-1)
        live = [0, 1, 2, 4]
        assert probs.shape == idx.shape == (5, min(256, v))
        assert torch.allclose(probs[live], want.values[live], rtol=1e-5, atol=1e-7), (variant, v)
        assert torch.equal(idx[live][want.values[live] > 0], want.indices[live][want.values[live] > 0]), (variant, v)
        assert probs[1, 0] == 1.0 and idx[1, 0] == v // 2 and probs[2, 2:].eq(0).all()
        assert torch.isnan(probs[3]).all()
    with pytest.raises(RuntimeError, match="positive"):
        k.top_candidates(torch.zeros(1, 8), torch.zeros(1), 4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_shapes_are_refused(variant):
    k = load(variant)
    packed = bq.pack_blocks(*bq.quantize_codes(torch.randn(8, 64), 4), 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        k.block_linear(torch.randn(1, 40), packed, 8)
    with pytest.raises(RuntimeError):
        k.block_linear(torch.randn(1, 64).double(), packed, 8)
    with pytest.raises(RuntimeError, match="packed"):
        k.block_linear(torch.randn(1, 96), packed, 8)  # the weights are for 64 inputs
    with pytest.raises(RuntimeError, match="packed"):
        k.block_linear(torch.randn(1, 64), packed, 40)  # and 8 outputs (one group of 16)


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def test_weights_moved_onto_huge_pages_are_the_same_weights():
    g = torch.Generator().manual_seed(0)
    tensors = [bq.pack_blocks(*bq.quantize_codes(torch.randn(48, 64, generator=g), 4), 4),
               bq.pack_q8(*bq.quantize_q8(torch.randn(20, 96, generator=g))),
               torch.randn(3, 5, generator=g), torch.arange(7, dtype=torch.int64)]
    moved = bq.onto_huge_pages(tensors)
    for a, b in zip(tensors, moved):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0 and b.data_ptr() != a.data_ptr()
    assert moved[0].data_ptr() % bq.HUGE_PAGE == 0
    for variant in VARIANTS:  # the kernels read the moved records as they did the originals
        x = torch.randn(2, 64, generator=g)
        k = load(variant)
        assert torch.equal(k.block_linear(x, moved[0], 48), k.block_linear(x, tensors[0], 48))
    if _thp_mode() in ("always", "madvise"):
        # The kernel was asked for 2 MB pages there (whether it found them depends on free memory).
        start = moved[0].data_ptr()
        flags = None
        for line in open("/proc/self/smaps"):
            if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
                lo, hi = (int(v, 16) for v in line.split(" ", 1)[0].split("-"))
                inside = lo <= start < hi
            elif line.startswith("VmFlags") and inside:
                flags = line.split()[1:]
                break
        assert flags is not None and "hg" in flags
