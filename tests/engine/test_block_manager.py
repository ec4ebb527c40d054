"""The KV cache in blocks: blocks taken as sequences grow and given back when they end, a shared
prefix referenced rather than copied, least-recently-freed eviction of cached prefixes, and the
pool's limit (checked on the tensors and tables, no model needed)."""

from __future__ import annotations

import pytest
import torch

from wafer.engine.block_manager import KVCacheFull
from wafer.engine.block_pool import HOLE
from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK, layer_bytes_per_token, plan_blocks, window_blocks
from wafer.models.config import ModelConfig

CFG = ModelConfig("llama", 100, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                  max_position_embeddings=256)


def fill(kv: KVCache, slot: int, tokens: list[int], n: int) -> None:
    """Pretend a forward pass wrote KV for tokens[:n]: each position's keys hold its token id."""
    kv.blocks.reserve(slot, n)
    blocks = kv.blocks.blocks_of(slot)
    for p in range(n):
        for k, v in kv.layers:  # [kv_heads, blocks, BLOCK, head_dim]
            k[:, blocks[p // BLOCK], p % BLOCK] = float(tokens[p])
            v[:, blocks[p // BLOCK], p % BLOCK] = -float(tokens[p])
    kv.blocks.set_length(slot, n)


def keys(kv: KVCache, slot: int, n: int) -> list[float]:
    """The first key element of the slot's first n positions, read through its table."""
    table = kv.blocks.tables[0, slot]
    return [float(kv.layers[0][0][0, table[p // BLOCK], p % BLOCK, 0]) for p in range(n)]


def test_a_shared_prefix_is_referenced_not_copied() -> None:
    kv = KVCache(CFG, num_slots=3, max_len=128)
    system = list(range(1, 2 * BLOCK + 5))  # two full blocks and a bit
    a = system + [90, 91, 92]
    sa, reused = kv.blocks.allocate(a)
    assert reused == 0 and kv.blocks.num_cached_blocks == 0
    fill(kv, sa, a, len(a))
    assert kv.blocks.block_refs(a) == [1, 1]  # findable while a still runs; its partial third block is not
    used = kv.blocks.num_blocks - kv.blocks.num_free_blocks
    b = system + [50] * 20
    sb, reused = kv.blocks.allocate(b)
    assert sb != sa and reused == 2 * BLOCK
    # The same storage, not a copy: b's table names a's blocks, and no block was taken for them.
    assert kv.blocks.blocks_of(sb) == kv.blocks.blocks_of(sa)[:2]
    assert kv.blocks.num_blocks - kv.blocks.num_free_blocks == used
    assert keys(kv, sb, reused) == [float(t) for t in system[:reused]]
    fill(kv, sb, b, len(b))
    assert kv.blocks.block_refs(system) == [2, 2]
    assert kv.blocks.blocks_of(sb)[2] not in kv.blocks.blocks_of(sa)  # b's own tokens went to a block of its own
    kv.blocks.free(sa)
    kv.blocks.free(sb)
    assert kv.blocks.num_used == 0 and kv.blocks.num_free == 3 and kv.blocks.usage == 0.0
    assert kv.blocks.block_refs(b) == [0, 0, 0]  # unreferenced, still findable
    c = b + [7, 8, 9]
    sc, reused = kv.blocks.allocate(c)
    assert reused == 3 * BLOCK and keys(kv, sc, reused) == [float(t) for t in c[:reused]]
    assert kv.blocks.prefix_hit_tokens == 2 * BLOCK + 3 * BLOCK


def test_the_block_of_the_prompts_last_token_is_never_shared() -> None:
    """The last prompt token is always computed (its logits give the first output token), and its
    KV is written: that block must be the sequence's own."""
    kv = KVCache(CFG, num_slots=2, max_len=128)
    a = list(range(1, 2 * BLOCK + 1))  # exactly two blocks
    s, _ = kv.blocks.allocate(a)
    fill(kv, s, a, len(a))
    kv.blocks.free(s)
    assert kv.blocks.allocate(a)[1] == BLOCK  # the same prompt again: the second block holds its last token


def test_memory_follows_the_tokens_held() -> None:
    kv = KVCache(CFG, num_slots=4, max_len=256, num_blocks=10)
    s, _ = kv.blocks.allocate()
    for n, blocks in ((1, 1), (BLOCK, 1), (BLOCK + 1, 2), (5 * BLOCK, 5)):
        kv.blocks.reserve(s, n)
        assert len(kv.blocks.blocks_of(s)) == blocks
    assert kv.blocks.usage == 0.5
    t, _ = kv.blocks.allocate()
    assert kv.blocks.room(t, 8 * BLOCK) == 5 * BLOCK  # five blocks left
    with pytest.raises(KVCacheFull):
        kv.blocks.reserve(t, 6 * BLOCK)
    assert kv.blocks.blocks_of(t) == []  # a refused reservation takes nothing
    kv.blocks.free(s)
    assert kv.blocks.usage == 0.0 and kv.blocks.num_free_blocks == 10
    kv.blocks.reserve(t, 10 * BLOCK)
    with pytest.raises(KVCacheFull):
        kv.blocks.reserve(t, 10 * BLOCK + 1)


def runs(blocks: list[int]) -> int:
    """How many runs of consecutive block numbers a sequence's blocks make."""
    return 1 + sum(b != a + 1 for a, b in zip(blocks, blocks[1:]))


def test_a_sequence_grows_in_one_run_of_blocks_beside_others() -> None:
    """Sequences decoding together take a block each in turn; each still holds one run of blocks
    (which the CPU streams), also once the pool's free blocks are scattered by sequences that ended
    in another order than they started; where its run's next block is taken it goes on elsewhere,
    and when the pool is full every free block is still used."""
    kv = KVCache(CFG, num_slots=4, max_len=512, num_blocks=64)
    slots = [kv.blocks.allocate()[0] for _ in range(4)]
    for n in range(1, 8 * BLOCK + 1):  # a token each, in turn
        for s in slots:
            kv.blocks.reserve(s, n)
    assert [runs(kv.blocks.blocks_of(s)) for s in slots] == [1, 1, 1, 1]
    for s in (slots[2], slots[0], slots[3], slots[1]):
        kv.blocks.free(s)
    again = [kv.blocks.allocate()[0] for _ in range(4)]
    for n in range(1, 8 * BLOCK + 1):
        for s in again:
            kv.blocks.reserve(s, n)
    assert [runs(kv.blocks.blocks_of(s)) for s in again] == [1, 1, 1, 1]
    # Past its home (16 blocks a slot here) a sequence's next block belongs to the next slot's run:
    # it goes on elsewhere, and the whole pool can still be taken.
    kv.blocks.reserve(again[0], 20 * BLOCK)
    assert len(set(kv.blocks.blocks_of(again[0])) & {b for s in again[1:] for b in kv.blocks.blocks_of(s)}) == 0
    kv.blocks.reserve(again[1], kv.blocks.room(again[1], 512))
    assert kv.blocks.num_free_blocks == 0 and len({b for s in again for b in kv.blocks.blocks_of(s)}) == 64


def test_written_bytes_count_each_block_once_and_stay() -> None:
    """The pools take memory on a block's first write and keep it: written_bytes grows with blocks never
    written before, not with blocks taken again, and stays when they are freed."""
    kv = KVCache(CFG, num_slots=2, max_len=256, num_blocks=8)
    per_block = kv.blocks.capacity_bytes // 8
    s, _ = kv.blocks.allocate()
    kv.blocks.reserve(s, 3 * BLOCK)
    assert kv.blocks.written_bytes == 3 * per_block
    kv.blocks.free(s)
    assert kv.blocks.written_bytes == 3 * per_block and kv.blocks.usage == 0.0
    t, _ = kv.blocks.allocate()
    kv.blocks.reserve(t, 3 * BLOCK)  # the same three blocks again
    assert kv.blocks.written_bytes == 3 * per_block
    kv.blocks.reserve(t, 8 * BLOCK)
    assert kv.blocks.written_bytes == kv.blocks.capacity_bytes


def test_cached_prefixes_give_their_storage_least_recently_freed_first() -> None:
    kv = KVCache(CFG, num_slots=2, max_len=128, num_blocks=4)
    x, y, z = ([t] * (2 * BLOCK + 1) for t in (1, 2, 3))
    for p in (x, y):
        s, _ = kv.blocks.allocate(p)
        fill(kv, s, p, 2 * BLOCK)
        kv.blocks.free(s)
    assert kv.blocks.block_refs(x) == [0, 0] and kv.blocks.block_refs(y) == [0, 0] and kv.blocks.num_free_blocks == 4
    s, reused = kv.blocks.allocate(z)
    assert reused == 0
    fill(kv, s, z, 2 * BLOCK)  # no block was ever unused: x's (freed first) give their storage
    assert kv.blocks.block_refs(x) == [] and kv.blocks.block_refs(y) == [0, 0]
    assert keys(kv, s, 2 * BLOCK) == [3.0] * (2 * BLOCK)
    kv.blocks.free(s)
    assert kv.blocks.allocate(x)[1] == 0  # x is really gone
    assert kv.blocks.allocate(z)[1] == 2 * BLOCK


def test_a_prefix_is_shared_only_up_to_the_first_different_block() -> None:
    kv = KVCache(CFG, num_slots=3, max_len=128)
    a = list(range(3 * BLOCK + 1))
    s, _ = kv.blocks.allocate(a)
    fill(kv, s, a, len(a))
    b = a[: BLOCK + 3] + [99] + a[BLOCK + 4 :]  # differs inside the second block only
    assert kv.blocks.allocate(b)[1] == BLOCK
    assert kv.blocks.allocate(None)[1] == 0


def test_tables_are_what_attention_reads() -> None:
    kv = KVCache(CFG, num_slots=2, max_len=64)
    s, _ = kv.blocks.allocate()
    kv.blocks.reserve(s, 3 * BLOCK)
    assert kv.blocks.tables[0, s, :3].tolist() == kv.blocks.blocks_of(s)
    assert torch.equal(kv.blocks.tables.new_tensor(kv.blocks.blocks_of(s)), kv.blocks.tables[0, s, :3])


def test_equal_blocks_computed_in_one_step_are_kept_once() -> None:
    """Two sequences given one system prompt in the same step each compute it; once computed,
    the second references the first's blocks and its own go back to the pool."""
    kv = KVCache(CFG, num_slots=2, max_len=128)
    system = list(range(1, 2 * BLOCK + 1))
    a, b = system + [90, 91], system + [50, 51, 52]
    sa, _ = kv.blocks.allocate(a)
    sb, _ = kv.blocks.allocate(b)
    kv.blocks.reserve(sa, len(a))
    kv.blocks.reserve(sb, len(b))
    free_before = kv.blocks.num_free_blocks
    fill(kv, sa, a, len(a))
    fill(kv, sb, b, len(b))
    assert kv.blocks.blocks_of(sb)[:2] == kv.blocks.blocks_of(sa)[:2]
    assert kv.blocks.num_free_blocks == free_before + 2
    assert kv.blocks.block_refs(system) == [2, 2]
    assert keys(kv, sb, len(b)) == [float(t) for t in b]
    kv.blocks.free(sa)
    kv.blocks.free(sb)
    assert kv.blocks.usage == 0.0


# Gemma 3's layout in small: windowed layers (a window of two blocks) around a global one.
WINDOW = 2 * BLOCK
WINDOWED = ModelConfig("gemma3", 100, 8, 16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4,
                       max_position_embeddings=512, layer_windows=[WINDOW, None, WINDOW])


def write(kv: KVCache, slot: int, tokens: list[int], start: int, end: int) -> None:
    """Pretend a step computed tokens[start:end] (keys hold the token id, in every layer, through
    its group's blocks), then mark them held, as the engine does after a step."""
    kv.blocks.reserve(slot, end)
    for layer, (k, v) in enumerate(kv.layers):
        blocks = kv.blocks.blocks_of(slot, kv.blocks.layer_group[layer])
        for p in range(start, end):
            k[:, blocks[p // BLOCK], p % BLOCK] = float(tokens[p])
            v[:, blocks[p // BLOCK], p % BLOCK] = -float(tokens[p])
    kv.blocks.set_length(slot, end)


def read(kv: KVCache, slot: int, layer: int, positions: range) -> list[float]:
    """Keys of a layer at the positions, read through its group's table as attention does."""
    table = kv.blocks.tables[kv.blocks.layer_group[layer], slot]
    return [float(kv.layers[layer][0][0, table[p // BLOCK], p % BLOCK, 0]) for p in positions]


def test_windowed_layers_hold_only_their_window() -> None:
    kv = KVCache(WINDOWED, num_slots=2, max_len=512, max_step=BLOCK)
    whole, windowed = kv.blocks.groups
    assert kv.blocks.layer_group == [1, 0, 1] and kv.blocks.tables.shape == (2, 2, 512 // BLOCK)
    per_slot = window_blocks(WINDOW, BLOCK)
    assert whole.num_blocks == 2 * 512 // BLOCK and windowed.num_blocks == 2 * per_slot
    tokens = list(range(1, 24 * BLOCK + 1))  # 24 blocks: more than the windowed pool has
    s, _ = kv.blocks.allocate(tokens)
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        write(kv, s, tokens, end - BLOCK, end)
        held = kv.blocks.blocks_of(s, 1)
        first = max(0, end - WINDOW + 1) // BLOCK  # the block of the next token's window start
        assert held[:first] == [HOLE] * first and HOLE not in held[first:]
        assert kv.blocks.tables[1, s, :first].tolist() == [0] * first
        assert len(kv.blocks.blocks_of(s, 0)) == end // BLOCK  # the global layer keeps every block
    # What the next token reads is there: the global layer every position, the windowed ones their window.
    end = len(tokens)
    assert read(kv, s, 1, range(end)) == [float(t) for t in tokens]
    for layer in (0, 2):
        assert read(kv, s, layer, range(end - WINDOW + 1, end)) == [float(t) for t in tokens[end - WINDOW + 1 :]]
    assert kv.blocks.peak_bytes <= 24 * whole.bytes_per_block + per_slot * windowed.bytes_per_block
    kv.blocks.free(s)
    assert kv.blocks.usage == 0.0 and windowed.num_free == windowed.num_blocks


def test_a_prefix_is_found_only_where_its_last_window_is_held() -> None:
    kv = KVCache(WINDOWED, num_slots=2, max_len=512, max_step=BLOCK)
    windowed = kv.blocks.groups[1]
    a = list(range(1, 10 * BLOCK + 2))  # ten full blocks and a token
    s, _ = kv.blocks.allocate(a)
    for end in range(BLOCK, len(a), BLOCK):
        write(kv, s, a, end - BLOCK, end)
    write(kv, s, a, 10 * BLOCK, len(a))
    kv.blocks.free(s)
    b = a[: 10 * BLOCK] + [7] * 5
    sb, reused = kv.blocks.allocate(b)
    assert reused == 10 * BLOCK  # the windowed layers still hold blocks 8 and 9: the last window
    first = (10 * BLOCK - WINDOW + 1) // BLOCK
    assert kv.blocks.blocks_of(sb, 1)[:first] == [HOLE] * first
    for layer in (0, 2):
        assert read(kv, sb, layer, range(10 * BLOCK - WINDOW + 1, 10 * BLOCK)) == [float(t) for t in a[129:160]]
    kv.blocks.free(sb)
    # Another sequence takes the windowed pool's storage (8 blocks: a's oldest went while a ran; 3..7,
    # then 9 and 8 are cached, least recently freed first, and the partial block is free), so the
    # window before position 160 is gone, and no shorter prefix has its window either, although the
    # global layer still holds all ten blocks.
    assert windowed.num_free == windowed.num_blocks == 8 and len(windowed.free) == 1
    c = [99] * (15 * BLOCK)
    sc, _ = kv.blocks.allocate(c)
    kv.blocks.reserve(sc, 7 * BLOCK)  # the free one, and 3..7 and 9
    kv.blocks.free(sc)
    assert kv.blocks.block_refs(b) == [0] * 10
    assert kv.blocks.allocate(b)[1] == 0


def test_without_windows_every_layer_keeps_the_whole_context() -> None:
    kv = KVCache(WINDOWED, num_slots=2, max_len=512, window_pool=0)
    assert kv.blocks.layer_group == [0, 0, 0] and len(kv.blocks.groups) == 1
    assert KVCache(WINDOWED, num_slots=2, max_len=WINDOW).blocks.layer_group == [0, 0, 0]  # the window is the whole context


def test_the_budget_is_shared_between_the_windowed_and_the_global_layers() -> None:
    per_layer = layer_bytes_per_token(WINDOWED) * BLOCK
    per_slot = window_blocks(WINDOW, 64)
    window = per_slot * 2 * per_layer  # a slot's window and step in the 2 windowed layers
    budget = 4 * window + 40 * per_layer  # 4 slots' windows, and 40 blocks of the one global layer
    assert plan_blocks(WINDOWED, torch.float32, 4, 512, budget, max_step=64) == (40, 4 * per_slot)
    kv = KVCache(WINDOWED, 4, 512, num_blocks=40, max_step=64)
    assert kv.blocks.capacity_bytes == budget
    # A budget short of every slot's window beside one whole sequence: as many windows as whole
    # sequences fit (at least one), the rest to the global layer.
    assert plan_blocks(WINDOWED, torch.float32, 4, 512, window + 10 * per_layer, max_step=64) == (10, per_slot)
    # Shorter still, a window would leave no more context than keeping every token in every layer
    # (20 blocks' bytes: 6 blocks of 3 layers): the windows are not used.
    assert plan_blocks(WINDOWED, torch.float32, 4, 512, 20 * per_layer, max_step=64) == (6, 0)
    # Every layer windowed (Mistral): as many slots' windows as the budget holds, else no windows.
    mistral = ModelConfig("mistral", 100, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                          max_position_embeddings=512, sliding_window=WINDOW)
    assert plan_blocks(mistral, torch.float32, 4, 512, 2 * window + per_layer, max_step=64) == (4 * 32, 2 * per_slot)
    assert plan_blocks(mistral, torch.float32, 4, 512, 10 * per_layer, max_step=64) == (5, 0)
    assert plan_blocks(CFG, torch.float32, 4, 512, 10 * 2 * per_layer) == (10, 0)  # no window: all to the whole group
