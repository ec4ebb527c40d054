"""A GGUF tensor's quantised blocks, read as they are into wafer's block records (blockquant.py).

wafer's records hold, per 32 inputs of an output channel, unsigned codes with a scale d and a
minimum m (value = d * code + m). Most of llama.cpp's block types are that already, or nearly:

    Q4_0  d (q - 8)                     -> 4-bit codes q, m = -8 d          exact
    Q4_1  d q + m                       -> 4-bit codes                      exact
    Q4_K  d sc q - dmin mn  (per 32)    -> 4-bit codes, d sc and dmin mn    scales rounded to float16
    Q5_0  d (q - 16)                    -> 8-bit codes q, m = -16 d         exact
    Q5_1  d q + m                       -> 8-bit codes                      exact
    Q5_K  as Q4_K with 5-bit q          -> 8-bit codes                      scales rounded to float16
    Q8_0  d q                           -> 8-bit codes q + 128, m = -128 d  exact

Any of them also goes into 8-bit records as it is (4-bit codes are 8-bit codes too), and the 5-bit
types into 5-bit records (6 bits a weight, against 9). Two K-quants have records of their own that
hold them exactly and in their own size (K4: Q4_K at 4.625 bits a weight, against 5 in 4-bit
records; K6: Q6_K at 6.5625, against 9 in 8-bit ones). Each layer takes the smallest record that
holds every tensor stacked into it as the file has it (format_for). The others (Q6_K beside other
types; Q2_K, Q3_K; float tensors) are dequantised a few rows at a time and quantised to the
record's width, so no tensor is ever held whole in float32.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize
from torch import nn

from wafer.models import blockquant as bq
from wafer.kernels.build import kernels
from wafer.models.quant import HEAD_BITS

FOUR_BIT = (T.Q4_0, T.Q4_1, T.Q4_K)  # held exactly (to float16 scales) by 4-bit records
AS_CODES = (*FOUR_BIT, T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0)  # held so by 8-bit records
ROWS_PER_CHUNK = 4096  # rows dequantised at once for the types that need it


K4, K6 = 44, 66  # blockquant.h's formats of the K-quant records (4, 5, 6 and 8 name the others by their bits)
FIVE_BIT = (T.Q5_0, T.Q5_1, T.Q5_K)


def format_for(qtypes: list[T], path: str, head: bool = False) -> int:
    """The records of a layer stacked from tensors of these types, on compute path q4 or q8: K4 or
    K6 where every part is Q4_K or Q6_K, and 5-bit records where every part is a 4- or 5-bit type
    and one is 5-bit (on both paths: the file's weights as they are, in less than 8 bits); else, on
    q4, 4 bits for 4-bit types and below, and 6 (HEAD_BITS) for an output head of wider ones; 8 bits
    for the rest."""
    if all(q == T.Q4_K for q in qtypes):
        return K4
    if all(q == T.Q6_K for q in qtypes):
        return K6
    if all(q in (*FOUR_BIT, *FIVE_BIT) for q in qtypes) and any(q in FIVE_BIT for q in qtypes):
        return 5
    bits = max(bits_for(q, path) for q in qtypes)
    return min(bits, HEAD_BITS) if head and path == "q4" else bits


def bits_for(qtype: T, path: str) -> int:
    """The record width a tensor of this type gets on a compute path: on q4 the narrowest that
    keeps its precision (4 bits for 4-bit types and below, 8 for wider ones); on q8 always 8."""
    return 8 if path == "q8" or qtype in (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0) else 4


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: element j is byte j's low nibble, element j + 16 its high one."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (little-endian 32 bits) -> bit j of each, for j = 0..31."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of a Q4_K/Q5_K block -> 6-bit scales and minimums of its eight sub-blocks
    (gguf-py's unpacking, which Q5_K shares)."""
    sc, mn = Q4_K.get_scale_min(s.reshape(-1, 12).numpy())
    shape = (*s.shape[:-1], 8)
    return torch.from_numpy(sc).reshape(shape), torch.from_numpy(mn).reshape(shape)


def _codes_of_blocks(raw: torch.Tensor, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw [N, row bytes] of a type in AS_CODES -> codes [N, K] uint8, d and m [N, K/32] float16."""
    n = raw.shape[0]
    block, size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(n, -1, size)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        d = _f16(b[..., 0:2])
        if qtype == T.Q8_0:
            codes = (b[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return codes.reshape(n, -1), d, d * -128
        if qtype in (T.Q4_1, T.Q5_1):
            m, rest = _f16(b[..., 2:4]), b[..., 4:]
        else:
            m, rest = d * (-8 if qtype == T.Q4_0 else -16), b[..., 2:]
        if qtype in (T.Q5_0, T.Q5_1):
            codes = _nibbles(rest[..., 4:]) | (_high_bits(rest[..., :4]) << 4)
        else:
            codes = _nibbles(rest)
        return codes.reshape(n, -1), d, m
    codes, sc, mn, d, dmin = _k_blocks(raw, qtype)
    d32 = (d.float().repeat_interleave(8, dim=1) * sc.float()).half()
    m32 = (-(dmin.float().repeat_interleave(8, dim=1) * mn.float())).half()
    return codes, d32, m32


def _k_blocks(raw: torch.Tensor, qtype: T) -> tuple[torch.Tensor, ...]:
    """Q4_K or Q5_K bytes [N, row bytes] -> codes [N, K], 6-bit scales and minimums [N, K/32] uint8,
    and the 256-input blocks' factors d and dmin [N, K/256] float16 (w = d sc q - dmin mn)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, GGML_QUANT_SIZES[qtype][1])
    sc, mn = _k_scales(b[..., 4:16])
    if qtype == T.Q4_K:
        qs = b[..., 16:144].reshape(n, -1, 4, 1, 32)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-2)  # sub-block 2c: low nibbles of chunk c, 2c+1: high
    else:  # Q5_K: qh[32] then qs[128]; sub-block j's fifth bit is bit j of qh
        qh, qs = b[..., 16:48], b[..., 48:176].reshape(n, -1, 4, 1, 32)
        low = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(n, -1, 8, 32)
        high = (qh.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1
        codes = low | (high << 4)
    return codes.reshape(n, -1), sc.reshape(n, -1), mn.reshape(n, -1), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _requantize(raw: torch.Tensor, qtype: T, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Types the records cannot hold as they are: a few rows at a time through float32."""
    out = []
    for start in range(0, raw.shape[0], ROWS_PER_CHUNK):
        rows = raw[start : start + ROWS_PER_CHUNK]
        w = torch.from_numpy(np.asarray(dequantize(rows.numpy(), qtype), dtype=np.float32).reshape(-1, k))
        if bits < 8:
            out.append(bq.quantize_codes(w, bits))
        else:
            q, d = bq.quantize_q8(w)
            out.append(((q.to(torch.int16) + 128).to(torch.uint8), d, (d.float() * -128).half()))
    return tuple(torch.cat(parts) for parts in zip(*out))  # type: ignore[return-value]


def record_inputs(raw: torch.Tensor, qtype: T, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF matrix's bytes [N, row bytes] -> what bq.pack_blocks takes: codes [N, K] uint8 and d, m
    [N, K/32] float16, for records of `bits` bits."""
    if qtype in AS_CODES and (bits == 8 or qtype in FOUR_BIT or (bits == 5 and qtype in FIVE_BIT)):
        return _codes_of_blocks(raw, qtype)
    return _requantize(raw, qtype, k, bits)


def _k6_inputs(raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K bytes [N, row bytes] -> bq.pack_k6's codes, sc, d. A block is ql[128], qh[64], sc[16]
    (int8, one per 16 inputs), d: input 128 h + 32 k + l has the low nibble of ql[64 h + 32 (k % 2)
    + l] (the high nibble for k >= 2) and bits 2k, 2k + 1 of qh[32 h + l] above it."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, GGML_QUANT_SIZES[T.Q6_K][1])
    ql = b[..., 0:128].reshape(n, -1, 2, 2, 32)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-2)  # k = 0, 1 from the low nibbles, 2, 3 from the high
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    codes = (low | (high << 4)).reshape(n, -1)
    return codes, b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1), _f16(b[..., 208:210])


def record_parts(raw: torch.Tensor, qtype: T, k: int, fmt: int) -> tuple[torch.Tensor, ...]:
    """What pack_records packs, for rows that may be stacked with other tensors' first."""
    if fmt == K4:
        return _k_blocks(raw, T.Q4_K)
    if fmt == K6:
        return _k6_inputs(raw)
    return record_inputs(raw, qtype, k, fmt)


def pack_records(parts: tuple[torch.Tensor, ...], fmt: int) -> torch.Tensor:
    if fmt == K4:
        return bq.pack_k4(*parts)
    if fmt == K6:
        return bq.pack_k6(*parts)
    return bq.pack_blocks(*parts, fmt)


def record_inputs_per(fmt: int) -> int:
    """Inputs of one record of the format: 256 for the K-quant records, else 32."""
    return 256 if fmt in (K4, K6) else bq.QK


def record_size(fmt: int) -> int:
    """Bytes of one record (csrc/blockquant.h's record_bytes)."""
    return {K4: 8 * 256 + 2 * 128 + 64, K6: 8 * 384 + 256 + 32}.get(fmt, (16 * bq.QK * fmt) // 8 + 64)


def record_bytes(n: int, k: int, fmt: int) -> int:
    """Bytes of the records of an [N, K] matrix."""
    return -(-n // 16) * (k // record_inputs_per(fmt)) * record_size(fmt)


class GGUFEmbedding(nn.Module):
    """An embedding table kept in the file's own blocks; the rows a step needs are dequantised
    on lookup (one row per token), so a quantised table never exists in float32."""

    def __init__(self, raw: torch.Tensor, qtype: T, dim: int) -> None:
        super().__init__()
        self.register_buffer("raw", raw)  # [vocab, row bytes] uint8
        self.qtype = qtype
        self.embedding_dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not ids.numel():  # gguf-py cannot reshape an empty array
            return torch.empty(*ids.shape, self.embedding_dim)
        if self.qtype == T.Q8_0 and (k := kernels()) is not None:  # SmolLM2's and Gemma 3's tables
            return k.embed_q8_0(self.raw, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
        rows = self.raw[ids.reshape(-1)]
        if self.qtype in AS_FLOAT:
            # Bitwise gguf-py's values in a few torch calls: gguf-py's own path runs through enough
            # Python and numpy to cost a decode step 0.1 ms or more, its code evicted from the
            # caches by the step's weights every time.
            return dequantize_f32(rows, self.qtype).reshape(*ids.shape, self.embedding_dim)
        w = np.asarray(dequantize(rows.numpy(), self.qtype), dtype=np.float32)
        return torch.from_numpy(w.reshape(*ids.shape, self.embedding_dim))


AS_FLOAT = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)  # dequantize_f32's types


def dequantize_f32(raw: torch.Tensor, qtype: T) -> torch.Tensor:
    """A GGUF matrix's bytes [N, row bytes] of a type in AS_FLOAT -> float32 [N, K], with gguf-py's
    arithmetic operation for operation (so bitwise what gguf.quants.dequantize gives, which the
    tests hold it to), on PyTorch's threads instead of numpy's loops over a few rows at a time:
    float32 loading of a 1.5B-parameter Q4_K_M file spent most of its 26 s there."""
    n = raw.shape[0]
    out = torch.empty(n, raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0])
    chunk = 256  # rows at a time: the steps' intermediates stay in cache
    for start in range(0, n, chunk):
        rows = raw[start : start + chunk]
        r = rows.shape[0]
        if qtype == T.Q4_K:
            codes, sc, mn, d, dmin = _k_blocks(rows, qtype)
            dl = d.float().repeat_interleave(8, dim=1) * sc.float()
            ml = dmin.float().repeat_interleave(8, dim=1) * mn.float()
            w = dl.unsqueeze(-1) * codes.view(r, -1, 32).float() - ml.unsqueeze(-1)
        elif qtype == T.Q6_K:
            codes, sc, d = _k6_inputs(rows)
            dl = d.float().repeat_interleave(16, dim=1) * sc.float()
            w = dl.unsqueeze(-1) * (codes.view(r, -1, 16).to(torch.int16) - 32).float()
        else:
            codes, d, m = _codes_of_blocks(rows, qtype)
            q = codes.view(r, -1, 32)
            if qtype == T.Q4_1:
                w = d.float().unsqueeze(-1) * q.float() + m.float().unsqueeze(-1)
            else:  # d (q - offset): Q8_0's codes are stored with 128 added
                offset = {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 128}[qtype]
                w = d.float().unsqueeze(-1) * (q.to(torch.int16) - offset).float()
        out[start : start + r] = w.reshape(r, -1)
    return out
