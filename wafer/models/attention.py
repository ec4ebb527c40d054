"""Attention over a slot-based KV cache, for a flat batch that mixes decode and prefill.

The cache of one layer is a pair of tensors shaped [slots, kv_heads, max_len, head_dim]: a sequence
owns a slot, and its keys are a contiguous view of it, so attention reads them without a copy.
Query heads are folded onto their KV head (grouped-query attention) instead of repeating K and V.
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
    slot: int
    context_len: int  # tokens of this sequence in the cache once this chunk is written
    masks: dict[int | None, torch.Tensor]  # per attention window: [length, context_len] bool, True where a query may look


@dataclass
class AttentionBatch:
    """Where each token of a flat batch lives in the cache, and how its queries are grouped.

    The first `num_decode` tokens are one token each of distinct sequences; they are attended
    together over the cache slots [0, decode_span). The rest are prefill chunks.
    """

    slots: torch.Tensor  # [N] slot of each token
    positions: torch.Tensor  # [N] position of each token in its sequence
    num_decode: int
    decode_slots: torch.Tensor  # [num_decode]
    decode_span: int  # attend over cache slots [0, decode_span)
    decode_len: int  # longest context among decode sequences
    decode_masks: dict[int | None, torch.Tensor]  # per attention window: [decode_span, 1, 1, decode_len] bool
    decode_dense: bool  # decode_slots == arange(decode_span): no scatter needed
    prefills: list[PrefillChunk]
    # Static shapes (CUDA graphs): decode tokens attend over the first decode_len positions of their
    # slots, gathered, under decode_masks [num_decode, 1, 1, decode_len]; decode_span is unused.
    static: bool = False

    @classmethod
    def static_decode(cls, slots: torch.Tensor, positions: torch.Tensor, max_len: int,
                      windows: list[int | None]) -> AttentionBatch:
        """One token per sequence at `positions` (< max_len) of `slots`, attending over positions
        [0, max_len) under a mask built on their device from the positions alone, so that the whole
        step can be captured in a CUDA graph."""
        lens = (positions + 1).unsqueeze(1)
        k = torch.arange(max_len, device=positions.device).unsqueeze(0)
        n = slots.shape[0]
        masks = {}
        for window in set(windows):
            mask = k < lens
            if window is not None:
                mask &= k > lens - 1 - window
            masks[window] = mask.view(n, 1, 1, max_len)
        return cls(slots=slots, positions=positions, num_decode=n, decode_slots=slots, decode_span=0,
                   decode_len=max_len, decode_masks=masks, decode_dense=False, prefills=[], static=True)

    def to(self, device: torch.device) -> AttentionBatch:
        """The same batch with its index tensors and masks on `device` (built on the CPU)."""
        if device.type == "cpu":
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return AttentionBatch(
            slots=move(self.slots), positions=move(self.positions), num_decode=self.num_decode,
            decode_slots=move(self.decode_slots), decode_span=self.decode_span, decode_len=self.decode_len,
            decode_masks={w: move(m) for w, m in self.decode_masks.items()}, decode_dense=self.decode_dense,
            prefills=[PrefillChunk(c.start, c.length, c.slot, c.context_len, {w: move(m) for w, m in c.masks.items()})
                      for c in self.prefills],
            static=self.static)


def causal_masks(start_pos: int, length: int, windows: set[int | None]) -> dict[int | None, torch.Tensor]:
    """Per window, the [length, start_pos + length] mask for queries at start_pos.. over keys 0..end."""
    q = torch.arange(start_pos, start_pos + length).unsqueeze(1)
    k = torch.arange(start_pos + length).unsqueeze(0)
    causal = k <= q
    return {w: causal if w is None else causal & (k > q - w) for w in windows}


def decode_masks(lengths: list[tuple[int, int]], span: int, max_len: int,
                 windows: set[int | None]) -> dict[int | None, torch.Tensor]:
    """Per window, the [span, 1, 1, max_len] mask for one query per (slot, length) at position length-1."""
    lens = torch.zeros(span, dtype=torch.long)
    for slot, n in lengths:
        lens[slot] = n
    lens = lens.clamp(min=1).unsqueeze(1)  # unused slots look at one key instead of none (avoids NaN rows)
    k = torch.arange(max_len).unsqueeze(0)
    causal = k < lens
    return {w: (causal if w is None else causal & (k > lens - 1 - w)).view(span, 1, 1, max_len) for w in windows}


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
    k_cache[batch.slots, :, batch.positions] = k
    v_cache[batch.slots, :, batch.positions] = v
    out = torch.empty_like(q)

    nd = batch.num_decode
    if nd and batch.static:
        qd = q[:nd].view(nd, n_kv, group, head_dim)
        length = batch.decode_len
        o = F.scaled_dot_product_attention(qd, k_cache[:, :, :length][batch.decode_slots],
                                           v_cache[:, :, :length][batch.decode_slots],
                                           attn_mask=batch.decode_masks[window], scale=scale)
        out[:nd] = o.reshape(nd, n_heads, head_dim)
    elif nd:
        span, length = batch.decode_span, batch.decode_len
        qd = q[:nd].view(nd, n_kv, group, head_dim)
        if not batch.decode_dense:
            full = q.new_zeros(span, n_kv, group, head_dim)
            full[batch.decode_slots] = qd
            qd = full
        o = F.scaled_dot_product_attention(
            qd, k_cache[:span, :, :length], v_cache[:span, :, :length], attn_mask=batch.decode_masks[window],
            scale=scale,
        )
        if not batch.decode_dense:
            o = o[batch.decode_slots]
        out[:nd] = o.reshape(nd, n_heads, head_dim)

    for chunk in batch.prefills:
        t = chunk.length
        qc = q[chunk.start : chunk.start + t].view(t, n_kv, group, head_dim)
        qc = qc.permute(1, 2, 0, 3).reshape(1, n_kv, group * t, head_dim)
        kc = k_cache[chunk.slot : chunk.slot + 1, :, : chunk.context_len]
        vc = v_cache[chunk.slot : chunk.slot + 1, :, : chunk.context_len]
        mask = chunk.masks[window].repeat(group, 1)
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
        o = o.view(n_kv, group, t, head_dim).permute(2, 0, 1, 3)
        out[chunk.start : chunk.start + t] = o.reshape(t, n_heads, head_dim)
    return out
