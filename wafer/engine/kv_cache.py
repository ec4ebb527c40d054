"""The KV cache: one slot per running sequence, all layers, KV heads never expanded.

A slot holds up to `max_len` tokens contiguously, so a sequence's keys are a view, not a gather.
The tensors are zero-filled lazily by the OS (calloc), so untouched capacity costs no memory.

Prefix caching: a finished sequence's slot stays warm with the tokens its KV holds. A new sequence
whose prompt starts with those tokens takes that slot and skips their prefill (multi-turn chats and
agent loops resend the whole history); warm slots are evicted least recently used when no cold one
is left. A prompt that continues a slot's whole content takes the slot over without a copy
(positions past the prefix are masked until overwritten); one that shares only part of it gets the
shared KV copied into a cold slot, so the warm entry survives for its own continuation.
"""

from __future__ import annotations

from collections import OrderedDict

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
        self._warm: OrderedDict[int, list[int]] = OrderedDict()  # slot -> tokens its KV holds, LRU first
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Slots a new sequence can have (cold ones and warm ones that may be evicted)."""
        return len(self._free) + len(self._warm)

    @property
    def num_used(self) -> int:
        return len(self._used_tokens)

    def allocate(self, prompt: list[int] | None = None, min_reuse: int = 16) -> tuple[int, int]:
        """A slot for a new sequence, and how many leading tokens of `prompt` its KV already holds
        (0 without a prompt, or when no warm slot shares at least `min_reuse` tokens)."""
        best, best_len = None, 0
        if prompt:
            self.prefix_queried_tokens += len(prompt)
            for slot, tokens in self._warm.items():
                n = _common_prefix(tokens, prompt)
                if n > best_len:
                    best, best_len = slot, n
        # At least one prompt token is always computed: its logits give the first output token.
        reuse = min(best_len, len(prompt) - 1) if prompt else 0
        if best is not None and reuse >= min_reuse:
            if best_len >= len(self._warm[best]) or not self._free:
                # The prompt continues everything the slot holds (a chat's next turn), or there is
                # no cold slot: take the warm slot over.
                del self._warm[best]
                slot = best
            else:
                # Only part of it is shared: keep the warm entry for its own continuation and copy
                # the shared prefix into a cold slot.
                slot = self._free.pop()
                self._copy(best, slot, reuse)
                self._warm.move_to_end(best)
            self.prefix_hit_tokens += reuse
        elif self._free:
            slot, reuse = self._free.pop(), 0
        else:
            slot, reuse = self._warm.popitem(last=False)[0], 0  # evict the least recently used
        self._used_tokens[slot] = reuse
        return slot, reuse

    def _copy(self, src: int, dst: int, n: int) -> None:
        for k, v in self.layers:
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]

    def free(self, slot: int, tokens: list[int] | None = None) -> None:
        """Give a slot back; with `tokens` (what its KV holds) it stays warm for prefix reuse."""
        if slot not in self._used_tokens:
            return
        del self._used_tokens[slot]
        if tokens:
            self._warm[slot] = list(tokens)
        else:
            self._free.append(slot)
            self._free.sort(reverse=True)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def set_length(self, slot: int, n: int) -> None:
        self._used_tokens[slot] = n

    @property
    def usage(self) -> float:
        """Fraction of token capacity held by live sequences."""
        return sum(self._used_tokens.values()) / (self.num_slots * self.max_len)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
