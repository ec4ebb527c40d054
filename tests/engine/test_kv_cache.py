"""The KV cache in blocks: blocks taken as sequences grow and given back when they end, a shared
prefix referenced rather than copied, least-recently-freed eviction of cached prefixes, and the
pool's limit (checked on the tensors and tables, no model needed)."""

from __future__ import annotations

import pytest
import torch

from wafer.engine.kv_cache import BLOCK, KVCache, KVCacheFull
from wafer.models.config import ModelConfig

CFG = ModelConfig("llama", 100, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                  max_position_embeddings=256)


def fill(kv: KVCache, slot: int, tokens: list[int], n: int) -> None:
    """Pretend a forward pass wrote KV for tokens[:n]: each position's keys hold its token id."""
    kv.reserve(slot, n)
    blocks = kv.blocks_of(slot)
    for p in range(n):
        for k, v in kv.layers:  # [kv_heads, blocks, BLOCK, head_dim]
            k[:, blocks[p // BLOCK], p % BLOCK] = float(tokens[p])
            v[:, blocks[p // BLOCK], p % BLOCK] = -float(tokens[p])
    kv.set_length(slot, n)


def keys(kv: KVCache, slot: int, n: int) -> list[float]:
    """The first key element of the slot's first n positions, read through its table."""
    table = kv.tables[slot]
    return [float(kv.layers[0][0][0, table[p // BLOCK], p % BLOCK, 0]) for p in range(n)]


def test_a_shared_prefix_is_referenced_not_copied() -> None:
    kv = KVCache(CFG, num_slots=3, max_len=128)
    system = list(range(1, 2 * BLOCK + 5))  # two full blocks and a bit
    a = system + [90, 91, 92]
    sa, reused = kv.allocate(a)
    assert reused == 0 and kv.num_cached_blocks == 0
    fill(kv, sa, a, len(a))
    assert kv.block_refs(a) == [1, 1]  # findable while a still runs; its partial third block is not
    used = kv.num_blocks - kv.num_free_blocks
    b = system + [50] * 20
    sb, reused = kv.allocate(b)
    assert sb != sa and reused == 2 * BLOCK
    # The same storage, not a copy: b's table names a's blocks, and no block was taken for them.
    assert kv.blocks_of(sb) == kv.blocks_of(sa)[:2]
    assert kv.num_blocks - kv.num_free_blocks == used
    assert keys(kv, sb, reused) == [float(t) for t in system[:reused]]
    fill(kv, sb, b, len(b))
    assert kv.block_refs(system) == [2, 2]
    assert kv.blocks_of(sb)[2] not in kv.blocks_of(sa)  # b's own tokens went to a block of its own
    kv.free(sa)
    kv.free(sb)
    assert kv.num_used == 0 and kv.num_free == 3 and kv.usage == 0.0
    assert kv.block_refs(b) == [0, 0, 0]  # unreferenced, still findable
    c = b + [7, 8, 9]
    sc, reused = kv.allocate(c)
    assert reused == 3 * BLOCK and keys(kv, sc, reused) == [float(t) for t in c[:reused]]
    assert kv.prefix_hit_tokens == 2 * BLOCK + 3 * BLOCK


def test_the_block_of_the_prompts_last_token_is_never_shared() -> None:
    """The last prompt token is always computed (its logits give the first output token), and its
    KV is written: that block must be the sequence's own."""
    kv = KVCache(CFG, num_slots=2, max_len=128)
    a = list(range(1, 2 * BLOCK + 1))  # exactly two blocks
    s, _ = kv.allocate(a)
    fill(kv, s, a, len(a))
    kv.free(s)
    assert kv.allocate(a)[1] == BLOCK  # the same prompt again: the second block holds its last token


def test_memory_follows_the_tokens_held() -> None:
    kv = KVCache(CFG, num_slots=4, max_len=256, num_blocks=10)
    s, _ = kv.allocate()
    for n, blocks in ((1, 1), (BLOCK, 1), (BLOCK + 1, 2), (5 * BLOCK, 5)):
        kv.reserve(s, n)
        assert len(kv.blocks_of(s)) == blocks
    assert kv.usage == 0.5
    t, _ = kv.allocate()
    assert kv.room(t, 8 * BLOCK) == 5 * BLOCK  # five blocks left
    with pytest.raises(KVCacheFull):
        kv.reserve(t, 6 * BLOCK)
    assert kv.blocks_of(t) == []  # a refused reservation takes nothing
    kv.free(s)
    assert kv.usage == 0.0 and kv.num_free_blocks == 10
    kv.reserve(t, 10 * BLOCK)
    with pytest.raises(KVCacheFull):
        kv.reserve(t, 10 * BLOCK + 1)


def test_cached_prefixes_give_their_storage_least_recently_freed_first() -> None:
    kv = KVCache(CFG, num_slots=2, max_len=128, num_blocks=4)
    x, y, z = ([t] * (2 * BLOCK + 1) for t in (1, 2, 3))
    for p in (x, y):
        s, _ = kv.allocate(p)
        fill(kv, s, p, 2 * BLOCK)
        kv.free(s)
    assert kv.block_refs(x) == [0, 0] and kv.block_refs(y) == [0, 0] and kv.num_free_blocks == 4
    s, reused = kv.allocate(z)
    assert reused == 0
    fill(kv, s, z, 2 * BLOCK)  # no block was ever unused: x's (freed first) give their storage
    assert kv.block_refs(x) == [] and kv.block_refs(y) == [0, 0]
    assert keys(kv, s, 2 * BLOCK) == [3.0] * (2 * BLOCK)
    kv.free(s)
    assert kv.allocate(x)[1] == 0  # x is really gone
    assert kv.allocate(z)[1] == 2 * BLOCK


def test_a_prefix_is_shared_only_up_to_the_first_different_block() -> None:
    kv = KVCache(CFG, num_slots=3, max_len=128)
    a = list(range(3 * BLOCK + 1))
    s, _ = kv.allocate(a)
    fill(kv, s, a, len(a))
    b = a[: BLOCK + 3] + [99] + a[BLOCK + 4 :]  # differs inside the second block only
    assert kv.allocate(b)[1] == BLOCK
    assert kv.allocate(None)[1] == 0


def test_tables_are_what_attention_reads() -> None:
    kv = KVCache(CFG, num_slots=2, max_len=64)
    s, _ = kv.allocate()
    kv.reserve(s, 3 * BLOCK)
    assert kv.tables[s, :3].tolist() == kv.blocks_of(s)
    assert torch.equal(kv.tables.new_tensor(kv.blocks_of(s)), kv.tables[s, :3])


def test_equal_blocks_computed_in_one_step_are_kept_once() -> None:
    """Two sequences given one system prompt in the same step each compute it; once computed,
    the second references the first's blocks and its own go back to the pool."""
    kv = KVCache(CFG, num_slots=2, max_len=128)
    system = list(range(1, 2 * BLOCK + 1))
    a, b = system + [90, 91], system + [50, 51, 52]
    sa, _ = kv.allocate(a)
    sb, _ = kv.allocate(b)
    kv.reserve(sa, len(a))
    kv.reserve(sb, len(b))
    free_before = kv.num_free_blocks
    fill(kv, sa, a, len(a))
    fill(kv, sb, b, len(b))
    assert kv.blocks_of(sb)[:2] == kv.blocks_of(sa)[:2]
    assert kv.num_free_blocks == free_before + 2
    assert kv.block_refs(system) == [2, 2]
    assert keys(kv, sb, len(b)) == [float(t) for t in b]
    kv.free(sa)
    kv.free(sb)
    assert kv.usage == 0.0
