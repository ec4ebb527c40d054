"""Which blocks of the KV cache each sequence holds: slots, block allocation and the prefix index.

A running sequence owns a slot: a row of `tables` listing, in order, the blocks that hold its
positions. Blocks are taken as its KV grows and given back when it ends, so a budget of blocks
bounds what the cache holds, not `max_running x max_len`. Layers come in groups with a pool and a
table each (as vLLM's hybrid allocator does): those that attend to the whole context, and those
with a window (Mistral's layers, five of Gemma 3's six), which hold about `window + step` of a
sequence's tokens (block_pool.py).

Prefix caching (as in vLLM): each full block is indexed by a digest chained over the whole prefix
up to it (a cryptographic one, so that equal digests mean equal prefixes) and its tokens are
checked too. A new prompt references the blocks that exist instead of computing or copying them;
a block is freed with its last reference, and a freed block that is indexed stays findable until
its storage is needed (least recently freed first). A prefix is found when every whole-context
group holds all its blocks and every windowed group the blocks of its last window. Only blocks
before the prompt's last token are shared: that token is always computed (its logits give the
first output token), so a shared block is never written to.

No tensor of keys or values here: kv_cache.py holds those, in the pools' layout.
"""

from __future__ import annotations

import hashlib
from array import array

import torch

from wafer.engine.block_pool import BlockPool
from wafer.engine.kv_layout import BLOCK, layer_bytes_per_token, layer_groups, slot_window
from wafer.models.config import ModelConfig


class KVCacheFull(RuntimeError):
    """No free block is left for a sequence's next tokens."""


class BlockManager:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 num_blocks: int | None = None, max_step: int | None = None, window_pool: int | None = None) -> None:
        """`num_blocks`: the whole-context layers' pool (default: enough for every slot to hold
        `max_len` tokens). The windowed layers' pools: `window_pool` blocks (0: no windowed pools,
        every layer keeps every token), or each slot's window and a step of `max_step` tokens (the
        most a sequence computes in one step: its user calls set_length after each, as the engine
        does; plan_blocks gives both sizes for a budget), or by default as large as the whole
        context's (still given back, but never short for a user that does not call set_length).
        `dtype`: the KV's element type, which sizes a block's bytes."""
        self.max_blocks = -(-max_len // BLOCK)  # per sequence
        num_blocks = num_blocks or num_slots * self.max_blocks
        kinds, self.layer_group = layer_groups(cfg, max_len, window_pool != 0)
        # The group (of pools and tables) that each attention window of the model reads.
        self.window_group = {w: g for w, g in zip(cfg.windows, self.layer_group)}
        self.tables = torch.zeros(len(kinds), num_slots, self.max_blocks, dtype=torch.long)  # [groups, slots, blocks]
        per_layer = layer_bytes_per_token(cfg, dtype) * BLOCK
        self.groups = [
            BlockPool(w, num_blocks if w is None else window_pool or num_slots * slot_window(w, max_step, self.max_blocks),
                      self.tables[g], per_layer * self.layer_group.count(g))
            for g, w in enumerate(kinds)
        ]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._used: dict[int, int] = {}  # live slot -> tokens computed
        self._tokens: dict[int, list[int]] = {}  # slot -> its token ids (for indexing its blocks)
        self._digests: dict[int, list[bytes]] = {}  # slot -> chained digests of its indexed leading blocks
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_bytes = 0  # the most bytes live sequences have held at once

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots a new sequence can have."""
        return len(self._free_slots)

    @property
    def num_used(self) -> int:
        """Live sequences."""
        return len(self._used)

    @property
    def num_blocks(self) -> int:
        """The first group's pool (the whole-context layers' where there are any)."""
        return self.groups[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """The first group's blocks a sequence can take."""
        return self.groups[0].num_free

    @property
    def num_cached_blocks(self) -> int:
        """The first group's indexed blocks: findable by a later prompt."""
        return len(self.groups[0].index)

    @property
    def live_bytes(self) -> int:
        """Bytes of the blocks live sequences reference."""
        return sum(g.num_live * g.bytes_per_block for g in self.groups)

    @property
    def capacity_bytes(self) -> int:
        return sum(g.num_blocks * g.bytes_per_block for g in self.groups)

    @property
    def written_bytes(self) -> int:
        """Bytes of the blocks written at least once: the pools take memory on first write and keep it
        (a freed block's pages stay, and a prefix-cached one keeps its KV), so the process's resident
        memory grows with this, up to capacity_bytes."""
        return sum(g.num_written * g.bytes_per_block for g in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of the pools' bytes referenced by live sequences."""
        return self.live_bytes / self.capacity_bytes

    @property
    def peak_usage(self) -> float:
        """The largest fraction of the pools' bytes live sequences have held at once."""
        return self.peak_bytes / self.capacity_bytes

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def blocks_of(self, slot: int, group: int = 0) -> list[int]:
        """The slot's blocks in position order (HOLE where a windowed group gave one back)."""
        return self.groups[group].blocks.get(slot, [])

    def block_refs(self, prompt: list[int]) -> list[int]:
        """How many sequences reference each of the first group's indexed blocks of `prompt` (to the first missing one)."""
        g, refs, digest = self.groups[0], [], b""
        for i in range(len(prompt) // BLOCK):
            digest, part = _block_hash(digest, prompt, i)
            b = g.find(digest, part)
            if b is None:
                break
            refs.append(g.ref[b])
        return refs

    # --- sequences -----------------------------------------------------------------------------
    def allocate(self, prompt: list[int] | None = None) -> tuple[int, int]:
        """A slot for a new sequence, and how many leading tokens of `prompt` its KV already holds
        (whole shared blocks before the prompt's last token; 0 without a prompt). `prompt` is the
        sequence's own token list: the cache reads it again to index the blocks it fills."""
        if not self._free_slots:
            raise KVCacheFull("no free slot")
        slot = self._free_slots.pop()
        found, digests = self._lookup(prompt, (len(prompt) - 1) // BLOCK) if prompt else ([[] for _ in self.groups], [])
        k = len(digests)
        for g, group in enumerate(self.groups):
            group.start(slot, found[g], k)
        reused = k * BLOCK
        if prompt is None:
            self._tokens.pop(slot, None)
        else:
            self._tokens[slot] = prompt
            self.prefix_queried_tokens += len(prompt)
            self.prefix_hit_tokens += reused
        self._digests[slot] = digests
        self._used[slot] = reused
        return slot, reused

    def _lookup(self, tokens: list[int], limit: int) -> tuple[list[list[int | None]], list[bytes]]:
        """The longest cached prefix of `tokens`, at most `limit` blocks: per group the block found
        for each of the prefix's blocks (None where there is none: a windowed group needs only its
        last window's), and their digests."""
        found: list[list[int | None]] = [[] for _ in self.groups]
        runs: list[list[int]] = [[] for _ in self.groups]  # blocks found in a row, ending at each block
        digests: list[bytes] = []
        for i in range(limit):
            digest, part = _block_hash(digests[-1] if digests else b"", tokens, i)
            hits = [g.find(digest, part) for g in self.groups]
            if any(b is None and g.window is None for g, b in zip(self.groups, hits)):
                break
            digests.append(digest)
            for g, b in enumerate(hits):
                found[g].append(b)
                runs[g].append(0 if b is None else 1 + (runs[g][-1] if runs[g] else 0))
        k = len(digests)
        while k and any(runs[g][k - 1] < k - group.needed_from(k * BLOCK) for g, group in enumerate(self.groups)):
            k -= 1
        return [f[:k] for f in found], digests[:k]

    def room(self, slot: int, n: int) -> int:
        """Tokens the slot can hold if it takes blocks up to `n` tokens, as far as free blocks allow."""
        want = min(-(-n // BLOCK), self.max_blocks)
        return min(g.room(slot, want) for g in self.groups) * BLOCK

    def reserve(self, slot: int, n: int) -> None:
        """Blocks for the slot's first n tokens (raises KVCacheFull when the pool cannot give them)."""
        want = -(-n // BLOCK)
        if want > self.max_blocks:
            raise KVCacheFull(f"{n} tokens exceed the slot's {self.max_len}")
        for g in self.groups:
            short = want - len(g.blocks.get(slot, [])) - g.num_free
            if short > 0:
                raise KVCacheFull(f"{short} more blocks wanted than are free")
        for g in self.groups:
            g.grow(slot, want)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def set_length(self, slot: int, n: int) -> None:
        """The slot's sequence now has KV for its first n tokens: its full blocks among them become
        findable, and windowed groups give back what the next tokens will not read."""
        self._used[slot] = n
        tokens = self._tokens.get(slot)
        if tokens is not None:
            digests = self._digests[slot]
            while len(digests) < n // BLOCK:
                i = len(digests)
                digest, part = _block_hash(digests[-1] if digests else b"", tokens, i)
                digests.append(digest)
                for g in self.groups:
                    g.index_block(slot, i, digest, part)
        for g in self.groups:
            if g.window is not None:
                g.pass_window(slot, n)

    def forget_prefixes(self) -> None:
        """Stop offering any block as a cached prefix: their contents are gone (a pipeline stage
        that held some of the layers was restarted). Called with no sequence live."""
        for g in self.groups:
            g.forget()
        for digests in self._digests.values():
            digests.clear()

    def free(self, slot: int) -> None:
        """Give a slot and its blocks back; its indexed blocks stay findable until their storage is needed."""
        if slot not in self._used:
            return
        del self._used[slot]
        for g in self.groups:
            g.drop(slot)
        self._tokens.pop(slot, None)
        self._digests.pop(slot, None)
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)


def _block_hash(prev: bytes, tokens: list[int], i: int) -> tuple[bytes, tuple[int, ...]]:
    """Block i's digest, chained on the digest of the blocks before it, and its tokens."""
    part = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
    return hashlib.blake2b(prev + array("q", part).tobytes(), digest_size=16).digest(), part
