"""The prefix index of the KV cache: chained block hashes, references per block, LRU eviction,
and copies that really carry the KV (checked on the tensors, no model needed)."""

from __future__ import annotations

import torch

from wafer.engine.kv_cache import BLOCK, KVCache
from wafer.models.config import ModelConfig

CFG = ModelConfig("llama", 100, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                  max_position_embeddings=256)


def fill(kv: KVCache, slot: int, tokens: list[int], n: int) -> None:
    """Pretend a forward pass wrote KV for tokens[:n]: each position's keys hold its token id."""
    for k, v in kv.layers:
        k[slot, :, :n] = torch.tensor(tokens[:n], dtype=torch.float32).view(1, n, 1)
        v[slot, :, :n] = -k[slot, :, :n]
    kv.set_length(slot, n)


def test_blocks_are_found_by_prefix_hash_and_reference_counted() -> None:
    kv = KVCache(CFG, num_slots=3, max_len=128)
    system = list(range(1, 2 * BLOCK + 5))  # two full blocks and a bit
    a = system + [90, 91, 92]
    sa, reused = kv.allocate(a)
    assert reused == 0 and kv.num_cached_blocks == 0
    fill(kv, sa, a, len(a))
    assert kv.block_refs(a) == [1, 1]  # findable while still running
    b = system + [50] * 20
    sb, reused = kv.allocate(b)  # shares the system prompt with a running sequence: copied
    assert sb != sa and reused == len(system)
    assert torch.equal(kv.layers[0][0][sb, :, :reused], kv.layers[0][0][sa, :, :reused])
    fill(kv, sb, b, len(b))
    assert kv.block_refs(system) == [2, 2]  # both slots hold both shared blocks
    kv.free(sa, a)
    kv.free(sb, b)
    assert kv.num_used == 0 and kv.num_free == 3
    # b's tail block is b's alone; the shared ones are referenced twice.
    assert kv.block_refs(b) == [2, 2, 1]
    # A third prompt continues b entirely: b's slot is taken over without a copy.
    c = b + [7, 8, 9]
    sc, reused = kv.allocate(c)
    assert sc == sb and reused == len(b)
    assert kv.prefix_hit_tokens == len(system) + len(b)


def test_eviction_drops_blocks_and_reuses_the_slot() -> None:
    kv = KVCache(CFG, num_slots=2, max_len=128)
    x, y, z = ([t] * (2 * BLOCK) for t in (1, 2, 3))
    for p in (x, y):
        s, _ = kv.allocate(p)
        fill(kv, s, p, len(p))
        kv.free(s, p)
    assert kv.block_refs(x) == [1, 1] and kv.block_refs(y) == [1, 1]
    s, reused = kv.allocate(z)  # nothing shared, no cold slot: x's slot (least recently used) goes
    assert reused == 0 and s == 0
    assert kv.block_refs(x) == [] and kv.block_refs(y) == [1, 1]
    fill(kv, s, z, len(z))
    assert kv.layers[0][0][s, 0, : len(z), 0].tolist() == [3.0] * len(z)  # the evicted storage now holds z
    kv.free(s, z)
    s2, reused = kv.allocate(x + [4])
    assert reused == 0  # x is really gone
    kv.free(s2)
    assert kv.allocate(z + [5])[1] == len(z)  # z's blocks in the reused slot are found


def test_partial_match_inside_a_block_and_no_prompt() -> None:
    kv = KVCache(CFG, num_slots=3, max_len=128)
    a = list(range(40))
    s, _ = kv.allocate(a)
    fill(kv, s, a, len(a))
    kv.free(s, a)
    b = a[:37] + [99, 98]  # diverges inside the third block: the shared 37 tokens are reused
    assert kv.allocate(b)[1] == 37
    assert kv.allocate(None)[1] == 0
    assert kv.block_refs(a[:BLOCK]) == [2]  # a (warm) and b (copied) both hold the first block
