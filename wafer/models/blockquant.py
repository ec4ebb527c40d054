"""Block-quantised weights in the layout of wafer's own CPU kernels (csrc/blockquant.h).

llama.cpp's block formats, 32 input elements per block: Q4_1 (4-bit codes with a scale and a
minimum per block), Q5_1 (5-bit codes, likewise) and Q8_0 (8-bit codes with a scale); and its K-quants Q4_K and Q6_K as they are
(K4 and K6 records, 256 inputs each), which only a GGUF file's blocks fill (gguf_blocks.py). Quantising a GGUF's Q4_1 or Q8_0 tensor,
once dequantised, gives back exactly the file's codes (every Q4_1 block holds a 0 and a 15 code,
every Q8_0 block a +-127), so these paths run the file's own weights. The kernels (wafer/kernels/build.py)
quantise the activations per block to int8 (as llama.cpp does) and use integer dot products.
"""

from __future__ import annotations

import torch

QK = 32


def quantize_codes(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> codes [N, K] uint8 in 0..2^bits - 1, scale and minimum [N, K/32] float16:
    w ~ d * q + m per block of 32, d and m from the block's range (Q4_1's rule at any width)."""
    n, k = w.shape
    top = (1 << bits) - 1
    blocks = w.float().reshape(n, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d16, m16 = ((hi - lo) / top).half(), lo.half()
    d, m = d16.float(), m16.float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((blocks - m[..., None]) * inv[..., None]).clamp(0, top).to(torch.uint8)
    return q.reshape(n, k), d16.contiguous(), m16.contiguous()


def pack_q8(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """quantize_q8's output -> the kernel's records: codes made unsigned (q + 128) with m = -128 d,
    exact in float16, so that one kernel serves both formats."""
    codes = (qs.to(torch.int16) + 128).to(torch.uint8)
    return pack_blocks(codes, d, (d.float() * -128).half(), 8)


def pack_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] uint8 with scales and minimums [N, K/32] float16 -> uint8 [ceil(N/16), K/32,
    record]: output channels in groups of 16 (the last padded with zeros) and for each group and
    block of 32 inputs one record: the codes such that each 64 bytes hold four consecutive inputs
    of the 16 channels (4 bits: 32 bytes' low nibbles and the next 32's high ones; 5 bits: that,
    then 64 bytes of the codes' fifth bits; 6 bits: that, then 128 bytes of their top two bits, as
    pack_k6 lays them out), then d[16] and m[16]. csrc/blockquant.h reads it."""
    n, k = codes.shape
    nb, groups = k // QK, -(-n // 16)
    codes, d, m = _pad_rows(groups * 16, codes, d, m)
    if bits == 4:
        body = _body4(codes, groups, nb)
    elif bits == 5:  # the low nibbles as a 4-bit body, then byte (c, t) holding bit 4 of input 4 j + t at bit j
        top = (codes >> 4).reshape(groups, 16, nb, 8, 4).permute(0, 2, 1, 4, 3)  # (g, b, c, t, j)
        plane = (top << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(groups, nb, 64)
        body = torch.cat([_body4(codes & 0x0F, groups, nb), plane], dim=-1)
    elif bits == 6:
        body = torch.cat([_body4(codes & 0x0F, groups, nb), _top2(codes, groups, nb)], dim=-1)
    else:  # k = 4 j + t; byte (j, c, t)
        body = codes.reshape(groups, 16, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 512)
    return torch.cat([body, *(_per_channel(t, groups) for t in (d, m))], dim=-1).contiguous()


def pack_k4(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_K as it is: codes [N, K] (0..15), 6-bit scales and minimums [N, K/32] uint8,
    super-block factors d and dmin [N, K/256] float16 (w = d sc q - dmin mn) -> K4 records uint8
    [ceil(N/16), K/256, 2368]: the eight blocks' 4-bit bodies, sc[8][16], mn[8][16], d[16], dmin[16]."""
    n, k = codes.shape
    groups, nsb = -(-n // 16), k // 256
    codes, sc, mn, d, dmin = _pad_rows(groups * 16, codes, sc, mn, d, dmin)
    body = _body4(codes, groups, k // QK).reshape(groups, nsb, 8 * 256)
    return torch.cat([body, _per_channel(sc, groups, 8), _per_channel(mn, groups, 8),
                      _per_channel(d, groups), _per_channel(dmin, groups)], dim=-1).contiguous()


def pack_k6(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q6_K as it is: codes [N, K] (0..63), scales [N, K/16] int8, super-block factors
    [N, K/256] float16 (w = d sc (q - 32)) -> K6 records uint8 [ceil(N/16), K/256, 3360]: per block
    of 32 the low nibbles as a 4-bit body and 128 bytes of top bits, byte (h, c, t) holding those of
    inputs 16 h + 4 s + t at bits 2 s; then sc[8][2][16], then d[16]."""
    n, k = codes.shape
    groups, nsb, nb = -(-n // 16), k // 256, k // QK
    codes, sc, d = _pad_rows(groups * 16, codes, sc, d)
    body = torch.cat([_body4(codes & 0x0F, groups, nb), _top2(codes, groups, nb)], dim=-1).reshape(groups, nsb, 8 * 384)
    return torch.cat([body, _per_channel(sc.view(torch.uint8), groups, 16), _per_channel(d, groups)], dim=-1).contiguous()


def _top2(codes: torch.Tensor, groups: int, nb: int) -> torch.Tensor:
    """6-bit codes [groups * 16, nb * 32] -> their top two bits [groups, nb, 128]: byte (h, c, t)
    holds those of inputs 16 h + 4 s + t of channel c at bits 2 s."""
    top = (codes >> 4).reshape(groups, 16, nb, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)  # (g, b, h, c, t, s)
    return (top << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(groups, nb, 128)


def _pad_rows(rows: int, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])]) if t.shape[0] < rows else t for t in ts]


def _body4(codes: torch.Tensor, groups: int, nb: int) -> torch.Tensor:
    """4-bit codes [groups * 16, nb * 32] -> bodies [groups, nb, 256]: input 8 i + 4 h + t of channel
    c in byte (i, c, t), low nibble for h = 0, high for h = 1."""
    c = codes.reshape(groups, 16, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(groups, nb, 256)


def _per_channel(t: torch.Tensor, groups: int, per: int = 1) -> torch.Tensor:
    """[groups * 16, n * per] -> bytes [groups, n, per * 16 * itemsize]: each of the n records' `per`
    values of the group's 16 channels, channel fastest."""
    n = t.shape[1] // per
    return t.reshape(groups, 16, n, per).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(groups, n, -1)


def dequantize_codes(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """quantize_codes' output -> [N, K] float32: d * q + m per block of 32."""
    n, nb = d.shape
    q = codes.reshape(n, nb, QK).float()
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(n, nb * QK)


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> codes [N, K] int8 and scales [N, K/32] float16, as llama.cpp quantises Q8_0."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // QK, QK)
    d16 = (blocks.abs().amax(-1) / 127).half()
    d = d16.float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d16.contiguous()


def dequantize_q8(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, nb = d.shape
    return (qs.reshape(n, nb, QK).float() * d.float()[..., None]).reshape(n, nb * QK)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels see of x: each block of 32 rounded to int8 steps of max|x| / 127."""
    m, k = x.shape
    blocks = x.reshape(m, k // QK, QK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(m, k)


HUGE_PAGE = 2 << 20


class HugePageArena:
    """One buffer that Linux is asked to back with 2 MB pages (transparent huge pages, madvise;
    `advise=False` leaves it on 4 KB pages, the baseline of bench/step_parts.py), filled by put().
    A decode step streams every weight once: on 4 KB pages that is ~25,000 pages a step for the
    default model, far more than the TLB holds. Where the system has no such pages, or declines,
    the buffer is plain memory and nothing else changes. Sized up front, so that a loader can
    move each weight in as it is made and never hold two copies of the model."""

    def __init__(self, nbytes: int, advise: bool = True) -> None:
        import mmap

        self.area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            if advise:
                self.area.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no THP on this system: plain pages
        self.buf = torch.frombuffer(self.area, dtype=torch.uint8)  # its tensors keep the mapping alive
        self.offset = (-self.buf.data_ptr()) % HUGE_PAGE  # huge pages back only 2 MB-aligned spans

    @staticmethod
    def size_of(t: torch.Tensor) -> int:
        return -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned, as PyTorch's own

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena (uint8), to be filled by the caller."""
        if self.offset + nbytes > self.buf.numel():
            raise ValueError("HugePageArena: full (sized too small)")
        view = self.buf[self.offset : self.offset + nbytes]
        self.offset += -(-nbytes // 64) * 64
        return view

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of CPU tensor t in the arena."""
        view = self.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        view.copy_(t)
        return view


def onto_huge_pages(tensors: list[torch.Tensor], advise: bool = True) -> list[torch.Tensor]:
    """Copies of CPU tensors, side by side in one HugePageArena."""
    import mmap

    if not tensors or not hasattr(mmap, "MAP_ANONYMOUS"):
        return list(tensors)
    arena = HugePageArena(sum(HugePageArena.size_of(t) for t in tensors), advise)
    return [arena.put(t) for t in tensors]
