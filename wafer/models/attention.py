"""Attention over a KV cache in blocks, for a flat batch that mixes decode and prefill.

The cache of one layer is a pair of pools shaped [kv_heads, num_blocks, BLOCK, row] (float32,
bfloat16, or int8 or fp8 rows of head_dim codes and a float32 scale); a sequence's positions lie in the
blocks its table lists, in order. Layers come in groups (those with a window hold only its blocks),
each with its own pool size and tables: the batch's block indices carry a group dimension, and a
layer reads its group's (`groups`, by its window). Each token's key and value are
written where its position falls; attention gathers a sequence's blocks into one run (on this path
a gather is the price of sharing blocks; the fused CPU step reads them in place). Query heads are
folded onto their KV head (grouped-query attention) instead of repeating K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """A run of `length` new tokens of one sequence, starting at flat index `start`."""

    start: int
    length: int
    table: torch.Tensor  # [groups, blocks] the sequence's blocks covering its first context_len tokens
    context_len: int  # tokens of this sequence in the cache once this chunk is written
    masks: dict[int | None, torch.Tensor]  # per attention window: [length, context_len] bool, True where a query may look


@dataclass
class AttentionBatch:
    """Where each token of a flat batch goes in the cache, and what its queries attend to.

    The first `num_decode` tokens are one token each of distinct sequences; they attend together
    over their blocks gathered to `decode_len` positions. The rest are prefill chunks.
    """

    write_blocks: torch.Tensor  # [groups, N] the block each token's K and V go to
    write_offsets: torch.Tensor  # [N] its place in that block
    positions: torch.Tensor  # [N] position of each token in its sequence
    num_decode: int
    decode_tables: torch.Tensor  # [groups, num_decode, decode_len / block] blocks of each decoding sequence
    decode_len: int  # positions gathered per decoding sequence (a whole number of blocks)
    decode_masks: dict[int | None, torch.Tensor]  # per attention window: [num_decode, 1, 1, decode_len] bool
    prefills: list[PrefillChunk]
    groups: dict[int | None, int]  # per attention window: the group of layers (of tables) it reads

    @classmethod
    def static_decode(cls, tables: torch.Tensor, positions: torch.Tensor, block: int,
                      groups: dict[int | None, int]) -> AttentionBatch:
        """One token per sequence at `positions`, whose blocks are the rows of `tables` [groups, n,
        blocks]: every index and mask is computed on their device from these tensors alone, so that
        the whole step can be captured in a CUDA graph."""
        _, n, nblk = tables.shape
        length = nblk * block
        lens = (positions + 1).unsqueeze(1)
        k = torch.arange(length, device=positions.device).unsqueeze(0)
        masks = {}
        for window in groups:
            mask = k < lens
            if window is not None:
                mask &= k > lens - 1 - window
            masks[window] = mask.view(n, 1, 1, length)
        at = (positions // block).view(1, n, 1).expand(tables.shape[0], n, 1)
        blocks = tables.gather(2, at).squeeze(2)
        return cls(write_blocks=blocks, write_offsets=positions % block, positions=positions, num_decode=n,
                   decode_tables=tables, decode_len=length, decode_masks=masks, prefills=[], groups=groups)

    def to(self, device: torch.device) -> AttentionBatch:
        """The same batch with its index tensors and masks on `device` (built on the CPU)."""
        if device.type == "cpu":
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return AttentionBatch(
            write_blocks=move(self.write_blocks), write_offsets=move(self.write_offsets),
            positions=move(self.positions), num_decode=self.num_decode, decode_tables=move(self.decode_tables),
            decode_len=self.decode_len, decode_masks={w: move(m) for w, m in self.decode_masks.items()},
            prefills=[PrefillChunk(c.start, c.length, move(c.table), c.context_len,
                                   {w: move(m) for w, m in c.masks.items()}) for c in self.prefills],
            groups=self.groups)


def causal_masks(start_pos: int, length: int, windows: set[int | None]) -> dict[int | None, torch.Tensor]:
    """Per window, the [length, start_pos + length] mask for queries at start_pos.. over keys 0..end."""
    q = torch.arange(start_pos, start_pos + length).unsqueeze(1)
    k = torch.arange(start_pos + length).unsqueeze(0)
    causal = k <= q
    return {w: causal if w is None else causal & (k > q - w) for w in windows}


def decode_masks(lengths: list[int], max_len: int, windows: set[int | None]) -> dict[int | None, torch.Tensor]:
    """Per window, the [len(lengths), 1, 1, max_len] mask for one query per sequence at position length-1."""
    lens = torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
    k = torch.arange(max_len).unsqueeze(0)
    causal = k < lens
    n = len(lengths)
    return {w: (causal if w is None else causal & (k > lens - 1 - w)).view(n, 1, 1, max_len) for w in windows}


def _gather(pool: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., blocks] tables -> [..., kv_heads, blocks * block, head_dim] in `dtype`: the blocks laid
    end to end (an int8 pool's rows dequantised with their scales)."""
    g = pool[:, tables]  # [kv, ..., blocks, block, row]
    g = g.movedim(0, -4)  # [..., kv, blocks, block, row]
    g = g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])
    if pool.dtype in (torch.int8, torch.float8_e4m3fn):
        return g[..., :-4].to(dtype) * g[..., -4:].contiguous().view(torch.float32).to(dtype)
    return g.to(dtype)


def _store(pool: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [N, kv, D] at (block, offset) per token, rounded to the pool's format: int8 rows get
    codes of x / scale, scale = max |x| / 127 per token and head, then the scale's bytes; fp8 (e4m3)
    rows the same with max |x| / 448, its largest finite value, rounded to the nearest code."""
    if pool.dtype not in (torch.int8, torch.float8_e4m3fn):
        pool[:, blocks, offsets] = x.to(pool.dtype).transpose(0, 1)
        return
    x = x.float()
    if pool.dtype == torch.int8:
        scale = x.abs().amax(-1, keepdim=True) / 127.0
        codes = torch.where(scale > 0, torch.round(x / scale), torch.zeros_like(x)).clamp(-127, 127).to(torch.int8)
    else:
        scale = x.abs().amax(-1, keepdim=True) / 448.0
        codes = torch.where(scale > 0, x / scale, torch.zeros_like(x)).clamp(-448, 448).to(torch.float8_e4m3fn)
    pool[:, blocks, offsets] = torch.cat((codes, scale.view(pool.dtype)), dim=-1).transpose(0, 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, Hkv, D] (already rotated). Writes k, v to the cache; returns [N, H, D].
    `window`: this layer's attention window (None: the whole context); the batch holds its masks."""
    n_tokens, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    g = batch.groups.get(window, 0)
    _store(k_cache, batch.write_blocks[g], batch.write_offsets, k)
    _store(v_cache, batch.write_blocks[g], batch.write_offsets, v)
    out = torch.empty_like(q)

    nd = batch.num_decode
    if nd:
        qd = q[:nd].view(nd, n_kv, group, head_dim)
        o = F.scaled_dot_product_attention(qd, _gather(k_cache, batch.decode_tables[g], q.dtype),
                                           _gather(v_cache, batch.decode_tables[g], q.dtype),
                                           attn_mask=batch.decode_masks[window], scale=scale)
        out[:nd] = o.reshape(nd, n_heads, head_dim)

    for chunk in batch.prefills:
        t, ctx = chunk.length, chunk.context_len
        qc = q[chunk.start : chunk.start + t].view(t, n_kv, group, head_dim)
        qc = qc.permute(1, 2, 0, 3).reshape(1, n_kv, group * t, head_dim)
        kc = _gather(k_cache, chunk.table[g], q.dtype)[:, :ctx].unsqueeze(0)
        vc = _gather(v_cache, chunk.table[g], q.dtype)[:, :ctx].unsqueeze(0)
        mask = chunk.masks[window].repeat(group, 1)
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
        o = o.view(n_kv, group, t, head_dim).permute(2, 0, 1, 3)
        out[chunk.start : chunk.start + t] = o.reshape(t, n_heads, head_dim)
    return out
