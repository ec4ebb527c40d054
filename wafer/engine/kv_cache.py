"""The KV cache: one slot per running sequence, all layers, KV heads never expanded.

A slot holds up to `max_len` tokens contiguously, so a sequence's keys are a view, not a gather
(a paged cache would copy every block of the context on every decode step on this CPU path).
The tensors are zero-filled lazily by the OS (calloc), so untouched capacity costs no memory.

Prefix caching: every slot's computed tokens are cut into blocks of BLOCK tokens, and each full
block is indexed by a hash chained over the whole prefix up to it (as in vLLM), with the set of
slots that hold it: a block lives while at least one slot references it. A new prompt walks its
own chain of block hashes to find the longest prefix some slot already holds, running or
finished. A finished sequence's slot stays warm; warm slots are evicted least recently used when
no cold one is left. A prompt that continues a warm slot's whole content takes the slot over without
a copy; one that shares only part of a slot's content, or shares a prefix with a running sequence
(concurrent requests with one system prompt), gets the shared KV copied into a slot of its own.
"""

from __future__ import annotations

import math

from collections import OrderedDict

import torch

from wafer.models.config import ModelConfig

BLOCK = 16  # tokens per hashed block


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that take memory only where written: on the CPU an anonymous mapping, whose pages the
    kernel provides (zeroed) on first write, so a cache sized for 16 sequences of 4096 tokens costs
    what its sequences hold, not 4 GB up front as torch.zeros would (it writes every byte)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(area, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)  # keeps `area` alive


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        # Zeros, not empty: masked positions still enter the attention product, and NaN * 0 is NaN.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(cfg.num_layers)
        ]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._used_tokens: dict[int, int] = {}  # live slot -> tokens computed
        self._warm: OrderedDict[int, None] = OrderedDict()  # finished slots kept for reuse, LRU first
        self._tokens: dict[int, list[int]] = {}  # slot -> its token ids (valid up to _valid[slot])
        self._valid: dict[int, int] = {}  # slot -> leading tokens whose KV it holds
        self._hashes: dict[int, list[int]] = {}  # slot -> chained hashes of its full blocks
        self._index: dict[int, set[int]] = {}  # block hash -> slots holding that block
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, max_len: int) -> KVCache:
        """A cache in the model's activation dtype, on its device."""
        emb = model.norm.weight  # type: ignore[union-attr]  # (the embedding may be held in file blocks)
        return cls(model.config, num_slots, max_len, emb.dtype, emb.device)  # type: ignore[arg-type]

    @property
    def num_free(self) -> int:
        """Slots a new sequence can have (cold ones and warm ones that may be evicted)."""
        return len(self._free) + len(self._warm)

    @property
    def num_used(self) -> int:
        return len(self._used_tokens)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def block_refs(self, prompt: list[int]) -> list[int]:
        """How many slots hold each full block of `prompt`'s prefix (stops at the first missing one)."""
        refs = []
        for h in _chain(prompt):
            slots = self._index.get(h)
            if not slots:
                break
            refs.append(len(slots))
        return refs

    def allocate(self, prompt: list[int] | None = None, min_reuse: int = BLOCK) -> tuple[int, int]:
        """A slot for a new sequence, and how many leading tokens of `prompt` its KV already holds
        (0 without a prompt, or when no slot shares at least `min_reuse` tokens). `prompt` is the
        sequence's own token list: the cache reads it again as the sequence's KV fills in."""
        src, shared = self._lookup(prompt) if prompt else (None, 0)
        if prompt:
            self.prefix_queried_tokens += len(prompt)
        # At least one prompt token is always computed: its logits give the first output token.
        reuse = min(shared, len(prompt) - 1) if prompt else 0
        if src is None or reuse < min_reuse:
            slot, reuse = (self._free.pop() if self._free else self._evict()), 0
        elif src in self._warm and (shared >= self._valid[src] or not self._free):
            # The prompt continues everything the warm slot holds (a chat's next turn), or there is
            # no cold slot: take it over; what lies past the shared prefix is dropped.
            del self._warm[src]
            slot = src
            self._truncate(slot, reuse)
        else:
            # Shared with a running sequence, or with part of a warm slot that stays for its own
            # continuation: copy the shared prefix into a slot of this sequence's own.
            slot = self._free.pop() if self._free else self._evict(keep=src)
            self._copy(src, slot, reuse)
            if src in self._warm:
                self._warm.move_to_end(src)
        if prompt is None:
            self._tokens.pop(slot, None)
        else:
            self._tokens[slot] = prompt
            self.prefix_hit_tokens += reuse
        self._used_tokens[slot] = self._valid[slot] = reuse
        self._register(slot)
        return slot, reuse

    def _lookup(self, prompt: list[int]) -> tuple[int | None, int]:
        """The slot sharing the longest prefix with `prompt`, and how long it is. Of equal
        matches, warm slots win (least recently used first: a takeover then evicts the oldest)."""
        candidates: set[int] = set()
        depth = 0
        for h in _chain(prompt):
            slots = self._index.get(h)
            if not slots:
                break
            candidates, depth = slots, depth + 1
        if not candidates:
            return None, 0
        base = depth * BLOCK
        order = [s for s in self._warm if s in candidates] + sorted(s for s in candidates if s not in self._warm)
        best, best_len = None, 0
        for slot in order:
            tokens, valid = self._tokens[slot], self._valid[slot]
            if tokens[:base] != prompt[:base]:  # a hash collision: never reuse someone else's KV
                continue
            n = base + _common_prefix(tokens[base:valid], prompt[base:])
            if n > best_len:
                best, best_len = slot, n
        return best, best_len

    def _evict(self, keep: int | None = None) -> int:
        """The least recently used warm slot (other than `keep`), its blocks forgotten."""
        slot = next(s for s in self._warm if s != keep)
        del self._warm[slot]
        self._truncate(slot, 0)
        return slot

    def _register(self, slot: int) -> None:
        """Index the slot's full blocks up to what it holds."""
        tokens = self._tokens.get(slot)
        if tokens is None:
            return
        hashes = self._hashes.setdefault(slot, [])
        prev = hashes[-1] if hashes else 0
        for b in range(len(hashes), self._valid[slot] // BLOCK):
            prev = _block_hash(prev, tokens, b)
            hashes.append(prev)
            self._index.setdefault(prev, set()).add(slot)

    def _truncate(self, slot: int, n: int) -> None:
        """Forget the slot's blocks past its first n tokens (a block dies with its last reference)."""
        hashes = self._hashes.get(slot, [])
        while len(hashes) > n // BLOCK:
            h = hashes.pop()
            holders = self._index[h]
            holders.discard(slot)
            if not holders:
                del self._index[h]
        self._valid[slot] = min(self._valid.get(slot, 0), n)

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
            self._tokens[slot] = list(tokens)
            self._truncate(slot, len(tokens))
            self._valid[slot] = len(tokens)
            self._register(slot)
            self._warm[slot] = None
        else:
            self._truncate(slot, 0)
            self._tokens.pop(slot, None)
            self._free.append(slot)
            self._free.sort(reverse=True)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def set_length(self, slot: int, n: int) -> None:
        """The slot's sequence now has KV for its first n tokens; full blocks among them become findable."""
        self._used_tokens[slot] = self._valid[slot] = n
        self._register(slot)

    @property
    def usage(self) -> float:
        """Fraction of token capacity held by live sequences."""
        return sum(self._used_tokens.values()) / (self.num_slots * self.max_len)


def _chain(tokens: list[int]):  # type: ignore[no-untyped-def]
    """The chained hashes of the full blocks of `tokens`, first block first."""
    prev = 0
    for b in range(len(tokens) // BLOCK):
        prev = _block_hash(prev, tokens, b)
        yield prev


def _block_hash(prev: int, tokens: list[int], b: int) -> int:
    """Block b's hash, chained on the hash of the blocks before it."""
    return hash((prev, *tokens[b * BLOCK : (b + 1) * BLOCK]))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
