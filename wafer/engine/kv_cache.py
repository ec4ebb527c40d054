"""The KV cache in blocks: memory follows the tokens held, and a shared prefix is stored once.

Every layer's keys and values live in one pool of blocks of BLOCK tokens,
[kv_heads, num_blocks, BLOCK, head_dim] (KV heads are never expanded), in float32, bfloat16, or int8
or fp8 (e4m3) with a scale per position and head: such a row is head_dim codes and then its float32
scale's 4 bytes, so that a row is written and read as one piece. A running sequence owns a
slot: a row of `tables` listing, in order, the blocks that hold its positions. Blocks are taken
as its KV grows and given back when it ends, so a budget of blocks bounds what the cache holds,
not `max_running x max_len`.

Prefix caching (as in vLLM): each full block that a sequence computed is indexed by a hash chained
over the whole prefix up to it. A new prompt walks its own chain and references the blocks that
exist instead of computing or copying them; a block is freed with its last reference, and a freed
block that is indexed stays findable until its storage is needed (least recently freed first).
Only blocks before the prompt's last token are shared: that token is always computed (its logits
give the first output token), so a shared block is never written to.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from wafer.models.config import ModelConfig

BLOCK = 16  # tokens per block, hashed and allocated alike


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


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V, all layers, for one token."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * row_size(cfg.head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", num_blocks: int | None = None) -> None:
        """`num_blocks`: the pool's size (default: enough for every slot to hold `max_len` tokens)."""
        self.max_blocks = -(-max_len // BLOCK)  # per sequence
        num_blocks = num_blocks or num_slots * self.max_blocks
        # A KV head's blocks lie together: a sequence's consecutive blocks of one head are then one
        # run of memory, which the CPU streams as it does a contiguous cache.
        shape = (cfg.num_kv_heads, num_blocks, BLOCK, row_size(cfg.head_dim, dtype))
        # Zeros, not empty: masked positions still enter the attention product, and NaN * 0 is NaN.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(cfg.num_layers)
        ]
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.max_len = max_len
        self.bytes_per_block = bytes_per_token(cfg, dtype) * BLOCK
        # Row s: the blocks of slot s in position order (entries past its length are stale).
        self.tables = torch.zeros(num_slots, self.max_blocks, dtype=torch.long)
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks
        self._blocks: dict[int, list[int]] = {}  # slot -> its blocks
        self._used: dict[int, int] = {}  # live slot -> tokens computed
        self._tokens: dict[int, list[int]] = {}  # slot -> its token ids (for indexing its blocks)
        self._hashes: dict[int, list[int]] = {}  # slot -> chained hashes of its indexed leading blocks
        self._index: dict[int, int] = {}  # chained hash -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # indexed block -> (its hash, its tokens)
        self._parent: dict[int, int] = {}  # indexed block -> the block before it (-1 for the first)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced indexed blocks, oldest first
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_blocks = 0  # the most blocks live sequences have held at once

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, max_len: int, num_blocks: int | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """A cache on the model's device, in `dtype` (default: the model's activation dtype)."""
        emb = model.norm.weight  # type: ignore[union-attr]  # (the embedding may be held in file blocks)
        return cls(model.config, num_slots, max_len, dtype or emb.dtype, emb.device, num_blocks)  # type: ignore[arg-type]

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
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: never used, or holding only an unreferenced cached prefix."""
        return len(self._free_blocks) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Indexed blocks: findable by a later prompt."""
        return len(self._index)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks referenced by live sequences."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def peak_usage(self) -> float:
        """The largest fraction of the pool's blocks live sequences have held at once."""
        return self.peak_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def blocks_of(self, slot: int) -> list[int]:
        return self._blocks.get(slot, [])

    def block_refs(self, prompt: list[int]) -> list[int]:
        """How many sequences reference each indexed block of `prompt`'s prefix (to the first missing one)."""
        return [self._ref[b] for b in self._walk(prompt, len(prompt) // BLOCK)]

    # --- sequences -----------------------------------------------------------------------------
    def allocate(self, prompt: list[int] | None = None) -> tuple[int, int]:
        """A slot for a new sequence, and how many leading tokens of `prompt` its KV already holds
        (whole shared blocks before the prompt's last token; 0 without a prompt). `prompt` is the
        sequence's own token list: the cache reads it again to index the blocks it fills."""
        if not self._free_slots:
            raise KVCacheFull("no free slot")
        slot = self._free_slots.pop()
        blocks = self._walk(prompt, (len(prompt) - 1) // BLOCK) if prompt else []
        for b in blocks:
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
        self._blocks[slot] = blocks
        self.tables[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        reused = len(blocks) * BLOCK
        if prompt is None:
            self._tokens.pop(slot, None)
        else:
            self._tokens[slot] = prompt
            self.prefix_queried_tokens += len(prompt)
            self.prefix_hit_tokens += reused
        self._hashes[slot] = [self._key[b][0] for b in blocks]
        self._used[slot] = reused
        return slot, reused

    def _walk(self, tokens: list[int], limit: int) -> list[int]:
        """The indexed blocks holding `tokens`' first blocks, at most `limit`, in order."""
        found: list[int] = []
        prev_hash, prev_block = 0, -1
        for i in range(limit):
            h, part = _block_hash(prev_hash, tokens, i)
            b = self._index.get(h)
            # The chain and the tokens are checked, not only the hash: another sequence's KV is never
            # served on a collision.
            if b is None or self._key[b][1] != part or self._parent[b] != prev_block:
                break
            found.append(b)
            prev_hash, prev_block = h, b
        return found

    def room(self, slot: int, n: int) -> int:
        """Tokens the slot can hold if it takes blocks up to `n` tokens, as far as free blocks allow."""
        have = len(self._blocks.get(slot, []))
        want = min(-(-n // BLOCK), self.max_blocks)
        return min(want, have + self.num_free_blocks) * BLOCK

    def reserve(self, slot: int, n: int) -> None:
        """Blocks for the slot's first n tokens (raises KVCacheFull when the pool cannot give them)."""
        blocks = self._blocks.setdefault(slot, [])
        want = -(-n // BLOCK)
        if want > self.max_blocks:
            raise KVCacheFull(f"{n} tokens exceed the slot's {self.max_len}")
        if want - len(blocks) > self.num_free_blocks:
            raise KVCacheFull(f"{want - len(blocks)} blocks wanted, {self.num_free_blocks} free")
        while len(blocks) < want:
            b = self._take_block()
            self.tables[slot, len(blocks)] = b
            blocks.append(b)
        self.peak_blocks = max(self.peak_blocks, self.num_blocks - self.num_free_blocks)

    def _take_block(self) -> int:
        if self._free_blocks:
            b = self._free_blocks.pop()
        else:  # the least recently freed cached prefix block gives up its storage
            b, _ = self._cached.popitem(last=False)
            self._unindex(b)
        self._ref[b] = 1
        return b

    def _unindex(self, b: int) -> None:
        h, _ = self._key.pop(b)
        del self._index[h]
        del self._parent[b]

    def set_length(self, slot: int, n: int) -> None:
        """The slot's sequence now has KV for its first n tokens; its full blocks among them become findable."""
        self._used[slot] = n
        tokens = self._tokens.get(slot)
        if tokens is None:
            return
        hashes, blocks = self._hashes[slot], self._blocks[slot]
        while len(hashes) < n // BLOCK:
            i = len(hashes)
            h, part = _block_hash(hashes[-1] if hashes else 0, tokens, i)
            hashes.append(h)
            b, parent = blocks[i], blocks[i - 1] if i else -1
            other = self._index.get(h)
            if other is None:
                if b not in self._key:
                    self._index[h] = b
                    self._key[b] = (h, part)
                    self._parent[b] = parent
            elif other != b and self._key[other][1] == part and self._parent[other] == parent:
                # Another sequence computed the same block in the same step (requests with one
                # system prompt arriving together): share its copy and give this one back.
                if self._ref[other] == 0:
                    del self._cached[other]
                self._ref[other] += 1
                blocks[i] = other
                self.tables[slot, i] = other
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    self._free_blocks.append(b)

    def forget_prefixes(self) -> None:
        """Stop offering any block as a cached prefix: their contents are gone (a pipeline stage
        that held some of the layers was restarted). Called with no sequence live."""
        for b in list(self._key):
            self._unindex(b)
        self._free_blocks.extend(self._cached)
        self._cached.clear()
        for hashes in self._hashes.values():
            hashes.clear()

    def free(self, slot: int) -> None:
        """Give a slot and its blocks back; its indexed blocks stay findable until their storage is needed."""
        if slot not in self._used:
            return
        del self._used[slot]
        for b in reversed(self._blocks.pop(slot, [])):  # freed last-first: a prefix's head outlives its tail
            self._ref[b] -= 1
            if self._ref[b]:
                continue
            if b in self._key:
                self._cached[b] = None
            else:
                self._free_blocks.append(b)
        self._tokens.pop(slot, None)
        self._hashes.pop(slot, None)
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)


def _block_hash(prev: int, tokens: list[int], i: int) -> tuple[int, tuple[int, ...]]:
    """Block i's hash, chained on the hash of the blocks before it, and its tokens."""
    part = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
    return hash((prev, part)), part
