"""The blocks of one group of layers (the whole-context layers, or those with a window): which are
free, how many sequences reference each, which hold an indexed prefix, and each slot's table.

A slot starts at a home of its own in the pool and takes the block after its last where it is free,
so that a sequence's blocks lie in runs however others grow: the CPU streams a run as it does a
contiguous cache, where blocks taken from anywhere in the free list are each a stream of their own.
A windowed group gives a block back as soon as the window has passed it; its entry in the table is
then a hole (block 0), which attention never reads.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import torch

from wafer.engine.kv_layout import BLOCK

HOLE = -1  # a windowed group's block given back, in a sequence's list (its table entry is 0)
PROBES = 32  # blocks from a slot's home looked at for its next one where the block after its last is taken


class BlockPool:
    """The blocks of one group of layers: free list, references, prefix index, and a table per slot."""

    def __init__(self, window: int | None, num_blocks: int, tables: torch.Tensor, bytes_per_block: int) -> None:
        self.window = window
        self.num_blocks = num_blocks
        self.tables = tables  # [slots, max_blocks]: a view of BlockManager.tables
        self.bytes_per_block = bytes_per_block
        # Free blocks (never used, or given back unindexed): a set, and a heap of them (with entries
        # of blocks taken out of turn left in it) for the lowest when no better one is free.
        self.free: set[int] = set(range(num_blocks))
        self._lowest = list(range(num_blocks))
        self.home_stride = max(1, num_blocks // max(1, tables.shape[0]))  # each slot's first block: slot x this
        self.ref = [0] * num_blocks
        self.written = bytearray(num_blocks)  # 1: taken at least once (its pages are resident since)
        self.num_written = 0
        self.blocks: dict[int, list[int]] = {}  # slot -> its blocks in position order (HOLE: given back)
        self.first: dict[int, int] = {}  # slot -> its first block not given back
        self.index: dict[bytes, int] = {}  # digest -> block
        self.key: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # indexed block -> (its digest, its tokens)
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced indexed blocks, oldest first

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: never used, or holding only an unreferenced cached prefix."""
        return len(self.free) + len(self.cached)

    @property
    def num_live(self) -> int:
        return self.num_blocks - self.num_free

    def needed_from(self, n: int) -> int:
        """The first block that a token at position n (and after) reads in this group."""
        return 0 if self.window is None else max(0, n - self.window + 1) // BLOCK

    def find(self, digest: bytes, part: tuple[int, ...]) -> int | None:
        b = self.index.get(digest)
        # The tokens are checked, not only the digest: another sequence's KV is never served.
        return b if b is not None and self.key[b][1] == part else None

    def hold(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.cached[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b]:
            return
        if b in self.key:
            self.cached[b] = None
        else:
            self._give(b)

    def start(self, slot: int, found: list[int | None], k: int) -> None:
        """The slot's blocks: the `k` found blocks this group needs (a windowed group only its last window's)."""
        lo = self.needed_from(k * BLOCK)
        blocks = [HOLE] * lo
        for i in range(lo, k):
            b = found[i]
            assert b is not None
            self.hold(b)
            blocks.append(b)
        self.blocks[slot] = blocks
        self.first[slot] = lo
        if k:
            self.tables[slot, :k] = torch.tensor([max(b, 0) for b in blocks], dtype=torch.long)

    def room(self, slot: int, want: int) -> int:
        """Blocks the slot can have, up to `want`."""
        have = len(self.blocks.get(slot, []))
        return min(want, have + self.num_free)

    def grow(self, slot: int, want: int) -> None:
        blocks = self.blocks.setdefault(slot, [])
        self.first.setdefault(slot, 0)
        while len(blocks) < want:
            if self.free:
                b = self._next_free(slot, blocks)
            else:  # the least recently freed cached prefix block gives up its storage
                b, _ = self.cached.popitem(last=False)
                del self.index[self.key.pop(b)[0]]
            self.ref[b] = 1
            if not self.written[b]:
                self.written[b] = 1
                self.num_written += 1
            self.tables[slot, len(blocks)] = b
            blocks.append(b)

    def _give(self, b: int) -> None:
        self.free.add(b)
        heapq.heappush(self._lowest, b)
        if len(self._lowest) > 2 * self.num_blocks:  # entries of blocks taken out of turn pile up
            self._lowest = sorted(self.free)

    def _next_free(self, slot: int, blocks: list[int]) -> int:
        """A free block for the slot's next one: the block after its last where free, else the first
        free one near the slot's home in the pool, else the lowest, so that its blocks lie in runs."""
        last = next((b for b in reversed(blocks) if b != HOLE), None)
        if last is not None and last + 1 in self.free:
            b = last + 1
        else:
            home = slot * self.home_stride
            b = next((c for c in range(home, min(home + PROBES, self.num_blocks)) if c in self.free), -1)
            while b < 0:
                c = heapq.heappop(self._lowest)
                b = c if c in self.free else -1
        self.free.remove(b)
        return b

    def index_block(self, slot: int, i: int, digest: bytes, part: tuple[int, ...]) -> None:
        """Block i of the slot is full: make it findable, or, when another sequence computed the
        same block in the same step (requests with one system prompt arriving together), share
        that copy and give this one back."""
        blocks = self.blocks[slot]
        b = blocks[i]
        if b == HOLE:
            return
        other = self.index.get(digest)
        if other is None:
            if b not in self.key:
                self.index[digest] = b
                self.key[b] = (digest, part)
        elif other != b and self.key[other][1] == part:
            self.hold(other)
            blocks[i] = other
            self.tables[slot, i] = other
            self.release(b)

    def pass_window(self, slot: int, n: int) -> None:
        """Give back the blocks that tokens from position n on no longer read."""
        lo = self.needed_from(n)
        blocks = self.blocks[slot]
        for i in range(self.first[slot], min(lo, len(blocks))):
            self.release(blocks[i])
            blocks[i] = HOLE
            self.tables[slot, i] = 0
        self.first[slot] = max(self.first[slot], lo)

    def drop(self, slot: int) -> None:
        for b in reversed(self.blocks.pop(slot, [])):  # freed last-first: a prefix's head outlives its tail
            if b != HOLE:
                self.release(b)
        self.first.pop(slot, None)

    def forget(self) -> None:
        self.index.clear()
        self.key.clear()
        for b in self.cached:
            self._give(b)
        self.cached.clear()
