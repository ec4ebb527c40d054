"""The KV cache's contents: every layer's keys and values, in pools of blocks of BLOCK tokens.

A layer's pool is [kv_heads, num_blocks, BLOCK, row] (KV heads are never expanded), in float32,
bfloat16, or int8 or fp8 (e4m3) with a scale per position and head: such a row is head_dim codes
and then its float32 scale's 4 bytes, so that a row is written and read as one piece. A KV head's
blocks lie together, so that a sequence's consecutive blocks of one head are one run of memory,
which the CPU streams as it does a contiguous cache. Which blocks a sequence holds is its
BlockManager's (`blocks`): the tensors here are only read and written through its tables.
"""

from __future__ import annotations

import math

import torch

from wafer.engine.block_manager import BlockManager
from wafer.engine.kv_layout import BLOCK, row_size
from wafer.models.config import ModelConfig


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that take memory only where written: on the CPU an anonymous mapping, whose pages the
    kernel provides (zeroed) on first write, so a pool sized for the whole budget costs what its
    blocks have held, not the budget up front as torch.zeros would (it writes every byte)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(area, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)  # keeps `area` alive


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", num_blocks: int | None = None, max_step: int | None = None,
                 window_pool: int | None = None) -> None:
        """The pools for the blocks of a BlockManager made with the same arguments (which see)."""
        self.blocks = BlockManager(cfg, num_slots, max_len, dtype, num_blocks, max_step, window_pool)
        self.dtype = dtype
        row = row_size(cfg.head_dim, dtype)
        # Zeros, not empty: masked positions still enter the attention product, and NaN * 0 is NaN.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for g in self.blocks.layer_group:
            shape = (cfg.num_kv_heads, self.blocks.groups[g].num_blocks, BLOCK, row)
            self.layers.append((_zeros(shape, dtype, device), _zeros(shape, dtype, device)))

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, max_len: int, num_blocks: int | None = None,
                  dtype: torch.dtype | None = None, max_step: int | None = None,
                  window_pool: int | None = None) -> KVCache:
        """A cache on the model's device, in `dtype` (default: the model's activation dtype)."""
        emb = model.norm.weight  # type: ignore[union-attr]  # (the embedding may be held in file blocks)
        return cls(model.config, num_slots, max_len, dtype or emb.dtype, emb.device, num_blocks,  # type: ignore[arg-type]
                   max_step, window_pool)

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy the KV rows of positions `src` of the slot's sequence to positions `dst`, in every
        layer: a verified draft tree's accepted path, to where its tokens now are. Every source is
        read before any destination is written."""
        if not src:
            return
        s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        for group, pools in zip(self.blocks.layer_group, self.layers):
            table = self.blocks.tables[group, slot]
            sb, so = table[s // BLOCK].to(self.device), (s % BLOCK).to(self.device)
            db, do = table[d // BLOCK].to(self.device), (d % BLOCK).to(self.device)
            for pool in pools:
                pool[:, db, do] = pool[:, sb, so]
