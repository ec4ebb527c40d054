"""How much prompt a step takes, alone and while others decode."""

from __future__ import annotations

import torch

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams


def _prompt_tokens_per_step(engine: LLMEngine, long_prompt: list[int]) -> list[int]:
    """Start one sequence decoding, then add a long prompt; the prompt tokens of each step until it is in."""
    engine.add([1, 2, 3, 4], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    engine.step()  # its prefill; it decodes from now on
    seq = engine.add(long_prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    counts = []
    while seq.num_cached < len(long_prompt) - 1 and not seq.finished:
        before = seq.num_cached
        engine.step()
        counts.append(seq.num_cached - before)
    return counts


def test_a_long_prompt_is_read_in_steps_of_bounded_time(smollm):
    long_prompt = list(range(100, 400))
    engine = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=512, max_batched_tokens=256,
                                            prefix_caching=False, prefill_step_seconds=0.04))
    # as if learned: 40 prompt tokens fit in the step's 40 ms on this machine's compute threads
    engine.budget.costs.observe(torch.get_num_threads(), 1, 0, 0.001 * torch.get_num_threads())
    engine.budget.observe = lambda scheduled, seconds: None  # and kept, whatever this machine's cost
    counts = _prompt_tokens_per_step(engine, long_prompt)
    assert max(counts[:-1]) <= 40 and max(counts) <= 40, counts

    free = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=512, max_batched_tokens=256,
                                          prefix_caching=False))
    assert max(_prompt_tokens_per_step(free, long_prompt)) == 256 - 1  # the whole budget but the decoder's


def test_a_prompt_alone_is_read_in_steps_of_bounded_time_too(smollm):
    """With no one decoding, the step still holds the server's loop (which answers every other
    request) for as long as it runs."""
    engine = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=512, max_batched_tokens=256,
                                            prefix_caching=False, prefill_step_seconds=0.04))
    engine.budget.costs.observe(torch.get_num_threads(), 1, 0, 0.001 * torch.get_num_threads())
    engine.budget.observe = lambda scheduled, seconds: None  # keep the cost as set, whatever this machine's
    seq = engine.add(list(range(100, 400)), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    counts = []
    while not seq.finished:
        before = seq.num_cached
        engine.step()
        counts.append(seq.num_cached - before)
    assert sum(counts) >= 299 and max(counts) <= 40, counts


def test_a_chunk_far_into_a_long_prompt_is_smaller_as_its_tokens_cost_more(smollm):
    """Attention makes a token at position p cost more than one at 0: with a cost learned as 1 ms a
    token plus 1% of that a position, each step's prompt work stays within 60 ms of it (a chunk of
    at least MIN_CHUNK tokens, or what 1.5 times that work buys far in), so the chunks shrink as the
    prompt goes on."""
    from wafer.engine.scheduler import FLOOR_OVERRUN, MIN_CHUNK
    from wafer.engine.step_cost import positions_of, tokens_within

    engine = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=512, max_batched_tokens=256,
                                            prefix_caching=False, prefill_step_seconds=0.06))
    threads = torch.get_num_threads()
    for tokens, positions in [(10, 0), (10, 1000), (20, 5000)]:  # a = 1 ms, b = 0.01 ms, per core
        engine.budget.costs.observe(threads, tokens, positions, threads * (0.001 * tokens + 0.00001 * positions))
    engine.budget.observe = lambda scheduled, seconds: None
    cap, per_position = engine.budget.cap()
    assert cap == 60 and abs(per_position - 0.01) < 1e-9
    seq = engine.add(list(range(100, 400)), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    chunks = []
    while not seq.finished:
        before = seq.num_cached
        engine.step()
        chunks.append((before, seq.num_cached - before))
    assert sum(n for _, n in chunks) >= 299
    for start, n in chunks[:-1]:  # within the step's work, or the floor: MIN_CHUNK, or what 1.5 x 60 buys there
        floor = min(MIN_CHUNK, tokens_within(FLOOR_OVERRUN * 60, start, per_position))
        assert n + per_position * positions_of(start, n) <= 60 or n == floor, chunks
        assert n + per_position * positions_of(start, n) <= FLOOR_OVERRUN * 60, chunks
    assert chunks[0][1] == 48 and chunks[-2][1] < MIN_CHUNK, chunks  # 48 at the start, under the floor far in


def test_the_cost_of_a_token_is_learned_from_prompt_steps(smollm):
    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, prefill_step_seconds=0.05))
    assert engine.budget.cap() == (None, 0.0)  # nothing measured yet: no cap
    engine.generate([list(range(100, 300))], SamplingParams(max_tokens=2, temperature=0))
    a, b = engine.budget.costs.coefficients(torch.get_num_threads())
    assert 0 < a < 0.05 and b >= 0
    assert engine.budget.cap()[0] >= 8


def test_a_step_on_fewer_compute_threads_takes_a_smaller_chunk(smollm):
    """The cost is learned per core: where the server leaves a core to a request it prepares, a step's
    chunk shrinks with its threads, so that the step still takes about the time allowed; once steps
    on one thread have been timed, their own cost sizes their chunks."""
    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, prefill_step_seconds=0.064))
    engine.budget.costs.observe(2, 1, 0, 0.002)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert engine.budget.cap() == (64, 0.0)
        torch.set_num_threads(1)
        assert engine.budget.cap() == (32, 0.0)
        engine.budget.costs.observe(1, 1, 0, 0.0016)  # on one thread a token costs fewer core-seconds
        assert engine.budget.cap() == (40, 0.0)
        torch.set_num_threads(2)
        assert engine.budget.cap() == (64, 0.0)
    finally:
        torch.set_num_threads(before)


def test_more_requests_than_the_kv_budget_holds_all_finish_as_alone(smollm):
    """Eight sequences that need 40 blocks in all, over a budget of 12: later ones are preempted and
    computed again, and every output equals the sequence run alone with room to spare."""
    from wafer.engine.kv_layout import BLOCK, bytes_per_token, kv_dtype

    prompts = [[1] + list(range(100 + 37 * i, 100 + 37 * i + 40)) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = LLMEngine(smollm, EngineConfig(max_running=1, max_model_len=256))
    want = [alone.generate([p], params)[0].tokens for p in prompts]

    budget = 12 * BLOCK * bytes_per_token(smollm.config, kv_dtype("auto", smollm))
    engine = LLMEngine(smollm, EngineConfig(max_running=8, max_model_len=256, kv_cache_memory=budget))
    assert engine.blocks.num_blocks == 12 and engine.max_model_len == 12 * BLOCK
    seqs = [engine.add(p, params) for p in prompts]
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, engine.blocks.num_blocks - engine.blocks.num_free_blocks)
    assert [s.tokens for s in seqs] == want
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.scheduler.num_preemptions > 0
    assert most <= 12 and engine.blocks.num_used == 0 and engine.blocks.usage == 0.0


def _small_scheduler(num_blocks: int = 32, max_len: int = 128, slots: int = 4):
    """A scheduler over the blocks of a one-layer model of no weights: four slots by default."""
    from wafer.engine.block_manager import BlockManager
    from wafer.engine.scheduler import Scheduler
    from wafer.models.config import ModelConfig

    cfg = ModelConfig("llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, max_position_embeddings=512)
    blocks = BlockManager(cfg, num_slots=slots, max_len=max_len, num_blocks=num_blocks)
    return blocks, Scheduler(blocks, max_running=slots, max_batched_tokens=256)


def test_sequences_in_flight_are_neither_scheduled_nor_preempted():
    """With pipeline stages, a step is scheduled while others are in flight: their sequences (busy)
    are left out, and a step takes at most max_seqs sequences."""
    from wafer.engine.kv_layout import BLOCK
    from wafer.engine.sequence import Sequence, Status

    blocks, sched = _small_scheduler(num_blocks=4, max_len=4 * BLOCK)  # a block each when all four run
    seqs = [Sequence(list(range(1, 10)), SamplingParams(max_tokens=40)) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule(max_seqs=2)
    assert [i.seq for i in first] == seqs[:2]
    second = sched.schedule(busy={s.seq_id for s in seqs[:2]}, max_seqs=2)
    assert [i.seq for i in second] == seqs[2:]
    assert sched.schedule(busy={s.seq_id for s in seqs}) == []
    for s in seqs:  # prompts computed, one token out: each decodes from here
        s.num_cached = len(s.tokens)
        s.tokens.append(7)
    # seqs[0] now needs a second block, and none is free: the last admitted, seqs[3], would give
    # its up, but its step is in flight.
    seqs[0].tokens += [7] * (BLOCK + 1 - len(seqs[0].tokens))
    seqs[0].num_cached = BLOCK
    out = sched.schedule(busy={seqs[3].seq_id})
    assert [i.seq for i in out] == seqs[1:3]
    assert sched.num_preemptions == 0 and seqs[3].status is Status.RUNNING
    out = sched.schedule()  # once it is back, it is preempted for the sequence admitted before it
    assert seqs[0] in [i.seq for i in out] and sched.preempted == [seqs[3]]


def _computed(blocks, out) -> None:
    """What the engine does after a step: each scheduled sequence holds KV up to its chunk's end."""
    for item in out:
        item.seq.num_cached = item.start + item.count
        blocks.set_length(item.seq.slot, item.seq.num_cached)


def test_a_prompt_that_shares_blocks_being_computed_waits_a_step_and_reuses_them():
    from wafer.engine.kv_layout import BLOCK
    from wafer.engine.sequence import Sequence

    blocks, sched = _small_scheduler()
    shared = [3] * (4 * BLOCK)
    a, b, c = (Sequence(shared + [10 + i] * 5, SamplingParams(max_tokens=4)) for i in range(3))
    other = Sequence([50] * (3 * BLOCK), SamplingParams(max_tokens=4))
    for s in (a, b, other, c):
        sched.add(s)
    first = sched.schedule()
    assert [i.seq for i in first] == [a, other]  # b and c would compute a's four blocks again beside it
    assert list(sched.waiting) == [b, c]
    _computed(blocks, first)
    second = sched.schedule()
    assert [i.seq for i in second] == [b, c]
    assert b.num_cached_prompt == c.num_cached_prompt == 4 * BLOCK
    assert [i.count for i in second] == [5, 5]


def test_with_steps_in_flight_a_prompt_does_not_wait_for_shared_blocks():
    """Pipeline stages index a step's blocks only when it comes back, after the next step is
    scheduled: waiting would only delay the prompt."""
    from wafer.engine.kv_layout import BLOCK
    from wafer.engine.sequence import Sequence

    blocks, sched = _small_scheduler()
    busy = Sequence([1] * 8, SamplingParams(max_tokens=4))
    sched.add(busy)
    sched.schedule()
    a, b = (Sequence([3] * (4 * BLOCK) + [10 + i], SamplingParams(max_tokens=4)) for i in range(2))
    sched.add(a)
    sched.add(b)
    assert [i.seq for i in sched.schedule(busy={busy.seq_id})] == [a, b]


def test_exactly_the_threshold_of_shared_blocks_makes_a_prompt_wait():
    from wafer.engine.kv_layout import BLOCK
    from wafer.engine.scheduler import SHARED_BLOCKS_TO_WAIT
    from wafer.engine.sequence import Sequence

    shared = SHARED_BLOCKS_TO_WAIT * BLOCK
    # b shares the threshold's blocks and has a token after them; c is only those blocks, so that its
    # last, which is always computed, falls in the last of them and one block fewer is shared; d shares
    # one block fewer.
    cases = {"b": ([3] * shared + [11], True), "c": ([3] * shared, False), "d": ([3] * (shared - BLOCK) + [12], False)}
    for name, (tokens, waits) in cases.items():
        blocks, sched = _small_scheduler()
        a = Sequence([3] * shared + [10], SamplingParams(max_tokens=4))
        other = Sequence(tokens, SamplingParams(max_tokens=4))
        sched.add(a)
        sched.add(other)
        assert [i.seq for i in sched.schedule()] == ([a] if waits else [a, other]), name


def test_prompts_that_share_less_than_two_blocks_start_together():
    from wafer.engine.kv_layout import BLOCK
    from wafer.engine.sequence import Sequence

    blocks, sched = _small_scheduler()
    shared = [3] * (BLOCK + 4)
    a, b = (Sequence(shared + [10 + i] * 20, SamplingParams(max_tokens=4)) for i in range(2))
    sched.add(a)
    sched.add(b)
    assert [i.seq for i in sched.schedule()] == [a, b]


def test_a_burst_with_one_system_prompt_computes_it_once(smollm):
    """Four requests with one long system prompt, arriving together, give what each gives alone,
    and the prompt's blocks are computed for the first only."""
    from wafer.engine.kv_layout import BLOCK

    system = smollm.tokenizer.encode("You are a careful assistant who answers in one short sentence. " * 6)
    prompts = [system + smollm.tokenizer.encode(f" Question {i}: what is {i} plus {i}?") for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0)
    alone = [LLMEngine(smollm, EngineConfig(max_running=4, prefix_caching=False)).generate([p], params)[0].output_ids
             for p in prompts]
    engine = LLMEngine(smollm, EngineConfig(max_running=4))
    together = [s.output_ids for s in engine.generate(prompts, params)]
    assert together == alone
    hits = engine.blocks.prefix_hit_tokens
    assert hits >= 3 * (len(system) // BLOCK - 1) * BLOCK, (hits, len(system))


def test_a_long_prompt_beside_decoders_is_read_in_chunks_of_min_chunk_or_more_and_none_of_them_waits():
    """Issue 54's probe: on a loaded machine the learned cost of a token shrank the step's prompt
    work to 8 tokens, and a 3,495-token prompt beside 4 streams took 127 s (3 s alone). However small
    the cap, each step decodes every stream and reads MIN_CHUNK tokens of the prompt, or as many as
    1.5 times that work buys far into it."""
    from wafer.engine.kv_layout import BLOCK
    from wafer.engine.scheduler import FLOOR_OVERRUN, MIN_CHUNK
    from wafer.engine.sequence import Sequence
    from wafer.engine.step_cost import positions_of, tokens_within

    blocks, sched = _small_scheduler(num_blocks=5 * (4096 // BLOCK), max_len=4096, slots=5)
    streams = [Sequence(list(range(1, 200)), SamplingParams(max_tokens=3000)) for _ in range(4)]
    for s in streams:
        sched.add(s)
    while any(s.num_cached < len(s.tokens) for s in streams):  # their prompts in; they decode from here
        _computed(blocks, sched.schedule())
    for s in streams:
        s.tokens.append(7)
    prompt = Sequence(list(range(500, 500 + 3495)), SamplingParams(max_tokens=1))
    sched.add(prompt)
    steps, starts = [], []
    while prompt.num_cached < len(prompt.tokens) and len(steps) < 1000:
        starts.append(prompt.num_cached)
        out = sched.schedule(prefill_cap=8, per_position=1.5e-3)  # the loaded machine's cap, and attention's cost
        _computed(blocks, out)
        for item in out:
            if item.seq is not prompt:
                item.seq.tokens.append(7)  # each decoder's token
        steps.append(([i.seq for i in out if i.seq is not prompt], sum(i.count for i in out if i.seq is prompt)))
    assert all(decoders == streams for decoders, _ in steps), "a step left a stream waiting"
    chunks = [n for _, n in steps]
    # Each chunk MIN_CHUNK tokens, or what FLOOR_OVERRUN times the step's work (at least MIN_CHUNK
    # tokens at position 0) buys at its position, whichever is fewer: never the cap's 8 tokens near
    # the start, and never a chunk that holds the loop for several times the step's work far in.
    floors = [min(MIN_CHUNK, tokens_within(FLOOR_OVERRUN * MIN_CHUNK, start, 1.5e-3)) for start in starts]
    assert all(n >= f for n, f in zip(chunks[:-1], floors)), (chunks, floors)
    assert min(chunks[:8]) >= MIN_CHUNK >= 32, chunks
    assert all(n + 1.5e-3 * positions_of(start, n) <= FLOOR_OVERRUN * MIN_CHUNK + 1e-9
               for start, n in zip(starts, chunks)), chunks
    # Each step but the last reads at least MIN_CHUNK tokens' work at position 0: 3,495 tokens whose
    # work grows to 6 tokens' a token, about 12,700 tokens' work, take at most 397 steps (279 here;
    # in chunks of 8, 437).
    assert all(n + 1.5e-3 * positions_of(start, n) >= MIN_CHUNK for start, n in zip(starts[:-1], chunks[:-1]))
    assert len(steps) <= 12_700 // MIN_CHUNK + 1, len(steps)
