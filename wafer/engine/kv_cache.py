"""The KV cache: one slot per running sequence, all layers, KV heads never expanded.

A slot holds up to `max_len` tokens contiguously, so a sequence's keys are a view, not a gather.
The tensors are zero-filled lazily by the OS (calloc), so untouched capacity costs no memory.
"""

from __future__ import annotations

import torch

from wafer.models.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        # Zeros, not empty: masked positions still enter the attention product, and NaN * 0 is NaN.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)
        ]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._used_tokens: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        slot = self._free.pop()
        self._used_tokens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._used_tokens:
            del self._used_tokens[slot]
            self._free.append(slot)
            self._free.sort(reverse=True)

    def set_length(self, slot: int, n: int) -> None:
        self._used_tokens[slot] = n

    @property
    def usage(self) -> float:
        """Fraction of token capacity held by live sequences."""
        return sum(self._used_tokens.values()) / (self.num_slots * self.max_len)

    def bytes_per_token(self) -> int:
        k = self.layers[0][0]
        return 2 * len(self.layers) * k.shape[1] * k.shape[3] * k.element_size()
