"""The KV cache in blocks: memory follows the tokens held, a shared prefix is stored once, and
layers with an attention window hold only that window.

Every layer's keys and values live in one pool of blocks of BLOCK tokens,
[kv_heads, num_blocks, BLOCK, row] (KV heads are never expanded), in float32, bfloat16, or int8
or fp8 (e4m3) with a scale per position and head: such a row is head_dim codes and then its float32
scale's 4 bytes, so that a row is written and read as one piece. A running sequence owns a
slot: a row of `tables` listing, in order, the blocks that hold its positions. Blocks are taken
as its KV grows and given back when it ends, so a budget of blocks bounds what the cache holds,
not `max_running x max_len`. Each slot starts at a home of its own in the pool and takes the block
after its last where it is free, so that a sequence's blocks lie in runs however others grow.

Layers come in groups with a pool size and a table each (as vLLM's hybrid allocator does): those
that attend to the whole context, and those with a window (Mistral's layers, five of Gemma 3's
six). A windowed group gives a block back as soon as the window has passed it, so a sequence holds
about `window + step` of its tokens there, and its pool is sized for that: a 32K-token Gemma 3
context costs its global layers' KV and five windows, not six whole caches. A given-back block's
entry in the table is a hole (block 0): attention never reads it (the fused step starts at the
window; the Python path reads and masks it).

Prefix caching (as in vLLM): each full block is indexed by a digest chained over the whole prefix
up to it (a cryptographic one, so that equal digests mean equal prefixes) and its tokens are
checked too. A new prompt references the blocks that exist instead of computing or copying them;
a block is freed with its last reference, and a freed block that is indexed stays findable until
its storage is needed (least recently freed first). A prefix is found when every whole-context
group holds all its blocks and every windowed group the blocks of its last window. Only blocks
before the prompt's last token are shared: that token is always computed (its logits give the
first output token), so a shared block is never written to.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections import OrderedDict

import torch

from wafer.models.config import ModelConfig

BLOCK = 16  # tokens per block, hashed and allocated alike
HOLE = -1  # a windowed group's block given back, in a sequence's list (its table entry is 0)
MAX_STEP = 256  # default: the most tokens one sequence computes in a step (a prompt chunk)
PROBES = 32  # blocks from a slot's home looked at for its next one where the block after its last is taken


class KVCacheFull(RuntimeError):
    """No free block is left for a sequence's next tokens."""


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


KV_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALED = (torch.int8, torch.float8_e4m3fn)  # codes with a float32 scale per position and head


def row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row at one position: int8 and fp8 rows end with their float32 scale's 4 bytes."""
    return head_dim + 4 if dtype in SCALED else head_dim


def layer_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V of one layer for one token."""
    return 2 * cfg.num_kv_heads * row_size(cfg.head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V, all layers, for one token (as a cache without windows holds them)."""
    return cfg.num_layers * layer_bytes_per_token(cfg, dtype)


def layer_groups(cfg: ModelConfig, max_len: int, windows: bool = True) -> tuple[list[int | None], list[int]]:
    """The groups' windows (None: the whole context, the first group where there is one) and each
    layer's group. A window as long as the context saves nothing: such a layer joins the whole
    group, as every layer does without `windows`."""
    kept = [w if windows and w is not None and w < max_len else None for w in cfg.windows]
    kinds: list[int | None] = [None] if None in kept else []
    if any(w is not None for w in kept):
        kinds.append(max(w for w in kept if w is not None))
    return kinds, [0 if w is None else len(kinds) - 1 for w in kept]


def window_blocks(window: int, max_step: int) -> int:
    """The most blocks a sequence holds in a group with `window`: those of its last window before a
    step of up to `max_step` tokens, that step's, and one more where they straddle block edges."""
    return (window - 1 + max_step) // BLOCK + 2


def _slot_window(window: int, max_step: int | None, max_blocks: int) -> int:
    """A slot's share of a windowed pool: its window and step, or (no step given) its whole context."""
    return min(window_blocks(window, max_step) if max_step else max_blocks, max_blocks)


def plan_blocks(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_len: int, budget: int,
                max_step: int = MAX_STEP, windows: bool = True) -> tuple[int, int]:
    """How `budget` bytes are shared: the blocks of the whole-context layers' pool (at least 1, at
    most every slot holding max_len tokens), and of the windowed layers' (0: none, every layer
    keeps every token). The windowed pools hold each slot's window and step where the budget holds
    that beside one sequence of max_len in the other layers, else as many slots' as it holds whole
    sequences; where it cannot hold one window and more context than the windows would save, the
    windows are not used."""
    kinds, groups = layer_groups(cfg, max_len, windows)
    per_layer = layer_bytes_per_token(cfg, dtype) * BLOCK
    max_blocks = -(-max_len // BLOCK)
    full = num_slots * max_blocks
    plain = max(1, min(full, budget // (cfg.num_layers * per_layer))), 0
    window = kinds[-1] if kinds and kinds[-1] is not None else None
    if window is None:
        return plain
    per_slot = _slot_window(window, max_step, max_blocks)
    windowed = groups.count(len(kinds) - 1) * per_layer * per_slot  # bytes: a slot's window
    whole = groups.count(0) * per_layer if kinds[0] is None else 0  # bytes: a block of the other layers
    if not whole:  # every layer windowed: as many slots' windows as the budget holds
        slots = min(num_slots, budget // windowed)
        return (full, slots * per_slot) if slots else plain
    slots = budget // (windowed + max_blocks * whole)
    if num_slots * windowed + max_blocks * whole <= budget:
        slots = num_slots
    if slots:
        return min(full, (budget - min(slots, num_slots) * windowed) // whole), min(slots, num_slots) * per_slot
    # Not one window beside a whole sequence: windows pay only where they leave more context.
    blocks = (budget - windowed) // whole
    return (blocks, per_slot) if blocks * BLOCK > window and blocks > plain[0] else plain


class _Group:
    """The blocks of one group of layers: free list, references, prefix index, and a table per slot."""

    def __init__(self, window: int | None, num_blocks: int, tables: torch.Tensor, bytes_per_block: int) -> None:
        self.window = window
        self.num_blocks = num_blocks
        self.tables = tables  # [slots, max_blocks]: a view of KVCache.tables
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
        free one near the slot's home in the pool, else the lowest. A sequence's blocks then lie in
        runs, which the CPU streams: taken from wherever the free list had them (as in a server that
        has run a while), each block of a head was a stream of its own, and 16 sequences decoding
        at ~750 tokens made about 1.3x fewer tokens a second."""
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


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", num_blocks: int | None = None, max_step: int | None = None,
                 window_pool: int | None = None) -> None:
        """`num_blocks`: the whole-context layers' pool (default: enough for every slot to hold
        `max_len` tokens). The windowed layers' pools: `window_pool` blocks (0: no windowed pools,
        every layer keeps every token), or each slot's window and a step of `max_step` tokens (the
        most a sequence computes in one step: its user calls set_length after each, as the engine
        does; plan_blocks gives both sizes for a budget), or by default as large as the whole
        context's (still given back, but never short for a user that does not call set_length)."""
        self.max_blocks = -(-max_len // BLOCK)  # per sequence
        num_blocks = num_blocks or num_slots * self.max_blocks
        kinds, self.layer_group = layer_groups(cfg, max_len, window_pool != 0)
        # The group (of pools and tables) that each attention window of the model reads.
        self.window_group = {w: g for w, g in zip(cfg.windows, self.layer_group)}
        self.tables = torch.zeros(len(kinds), num_slots, self.max_blocks, dtype=torch.long)  # [groups, slots, blocks]
        per_layer = layer_bytes_per_token(cfg, dtype) * BLOCK
        self.groups = [
            _Group(w, num_blocks if w is None else window_pool or num_slots * _slot_window(w, max_step, self.max_blocks),
                   self.tables[g], per_layer * self.layer_group.count(g))
            for g, w in enumerate(kinds)
        ]
        # A KV head's blocks lie together: a sequence's consecutive blocks of one head are then one
        # run of memory, which the CPU streams as it does a contiguous cache.
        row = row_size(cfg.head_dim, dtype)
        # Zeros, not empty: masked positions still enter the attention product, and NaN * 0 is NaN.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for g in self.layer_group:
            shape = (cfg.num_kv_heads, self.groups[g].num_blocks, BLOCK, row)
            self.layers.append((_zeros(shape, dtype, device), _zeros(shape, dtype, device)))
        self.num_slots = num_slots
        self.max_len = max_len
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._used: dict[int, int] = {}  # live slot -> tokens computed
        self._tokens: dict[int, list[int]] = {}  # slot -> its token ids (for indexing its blocks)
        self._digests: dict[int, list[bytes]] = {}  # slot -> chained digests of its indexed leading blocks
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_bytes = 0  # the most bytes live sequences have held at once

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, max_len: int, num_blocks: int | None = None,
                  dtype: torch.dtype | None = None, max_step: int | None = None,
                  window_pool: int | None = None) -> KVCache:
        """A cache on the model's device, in `dtype` (default: the model's activation dtype)."""
        emb = model.norm.weight  # type: ignore[union-attr]  # (the embedding may be held in file blocks)
        return cls(model.config, num_slots, max_len, dtype or emb.dtype, emb.device, num_blocks,  # type: ignore[arg-type]
                   max_step, window_pool)

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
