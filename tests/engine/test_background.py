"""Background sequences (the Batch API's lines) run only where interactive ones leave room: they
queue behind them, sit out every step that reads an interactive prompt, and give up their slot or
blocks first. On a scheduler over the blocks of a model of no weights."""

from __future__ import annotations

import pytest

from wafer.engine.kv_layout import BLOCK
from wafer.engine.sequence import SamplingParams, Sequence, Status


def _scheduler(num_blocks: int = 32, max_running: int = 4):
    from wafer.engine.block_manager import BlockManager
    from wafer.engine.scheduler import Scheduler
    from wafer.models.config import ModelConfig

    cfg = ModelConfig("llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, max_position_embeddings=512)
    blocks = BlockManager(cfg, num_slots=max_running, max_len=8 * BLOCK, num_blocks=num_blocks)
    return blocks, Scheduler(blocks, max_running=max_running, max_batched_tokens=256)


def _seq(tokens: list[int], background: bool = False) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=40), background=background)


def _step(blocks, out) -> None:
    """What the engine does after a step: KV up to each chunk's end, and a token where it sampled."""
    for item in out:
        seq = item.seq
        seq.num_cached = item.start + item.count
        blocks.set_length(seq.slot, seq.num_cached)
        if seq.num_cached == len(seq.tokens):
            seq.tokens.append(7)


def test_an_interactive_request_goes_ahead_of_waiting_batch_work():
    _, sched = _scheduler()
    batch = [_seq([1, 2, 3], background=True) for _ in range(3)]
    for s in batch:
        sched.add(s)
    first = _seq([5, 6, 7])
    second = _seq([8, 9])
    sched.add(first)
    sched.add(second)
    assert list(sched.waiting) == [first, second, *batch]


def test_batch_work_sits_out_the_steps_that_read_an_interactive_prompt():
    blocks, sched = _scheduler()
    batch = [_seq([1, 2, 3, 4], background=True) for _ in range(2)]
    for s in batch:
        sched.add(s)
    out = sched.schedule()
    assert [i.seq for i in out] == batch
    _step(blocks, out)
    out = sched.schedule()
    assert [i.seq for i in out] == batch  # decoding, alone: they run
    _step(blocks, out)
    waiting_batch = _seq([9, 9, 9], background=True)
    sched.add(waiting_batch)
    chat = _seq(list(range(10, 110)))
    sched.add(chat)
    # The step that reads the interactive prompt carries no batch work: not the running batch
    # sequences (which keep their blocks) nor the waiting one.
    out = sched.schedule(prefill_cap=40)
    assert [i.seq for i in out] == [chat] and out[0].count == 40
    assert all(s.status is Status.RUNNING and s.slot is not None for s in batch)
    _step(blocks, out)
    out = sched.schedule(prefill_cap=40)
    assert [i.seq for i in out] == [chat]  # its prompt still being read: still alone
    _step(blocks, out)
    out = sched.schedule(prefill_cap=64)
    assert [i.seq for i in out] == [chat] and out[0].count == 20
    _step(blocks, out)  # its prompt is in, and it has its first token
    out = sched.schedule()  # then the batch work goes on beside it, and the waiting line is admitted
    assert [i.seq for i in out] == [chat, *batch, waiting_batch]


def test_an_interactive_request_takes_a_batch_sequences_slot():
    blocks, sched = _scheduler(max_running=2)
    batch = [_seq([1, 2, 3], background=True) for _ in range(3)]
    for s in batch:
        sched.add(s)
    out = sched.schedule()
    assert [i.seq for i in out] == batch[:2]  # every slot taken
    _step(blocks, out)
    chat = _seq([5, 6, 7])
    sched.add(chat)
    out = sched.schedule()
    assert [i.seq for i in out] == [chat]
    # The batch sequence admitted last gave its slot, and waits behind interactive work, first of the batch's.
    assert batch[1].status is Status.WAITING and sched.preempted == [batch[1]]
    assert list(sched.waiting) == [batch[1], batch[2]]
    late = _seq([8, 8])
    sched.add(late)
    assert list(sched.waiting) == [late, batch[1], batch[2]]


def test_an_interactive_sequence_takes_a_batch_sequences_block_though_admitted_after_it():
    blocks, sched = _scheduler(num_blocks=2)
    batch = _seq([1] * (BLOCK - 4), background=True)
    sched.add(batch)
    _step(blocks, sched.schedule())
    chat = _seq([4] * (BLOCK - 1))  # its second block is wanted once its first token is out
    sched.add(chat)
    _step(blocks, sched.schedule())
    out = sched.schedule()
    assert [i.seq for i in out] == [chat, batch]
    _step(blocks, out)
    out = sched.schedule()  # no block is free: the batch sequence gives its up, not the one admitted last
    assert [i.seq for i in out] == [chat] and sched.preempted == [batch]
    assert chat.status is Status.RUNNING and batch.status is Status.WAITING


def test_a_batch_sequence_short_of_a_block_never_takes_an_interactive_ones():
    blocks, sched = _scheduler(num_blocks=2)
    batch = _seq([1] * (BLOCK - 1), background=True)
    sched.add(batch)
    _step(blocks, sched.schedule())
    chat = _seq([4] * (BLOCK - 4))
    sched.add(chat)
    _step(blocks, sched.schedule())
    out = sched.schedule()
    assert [i.seq for i in out] == [chat, batch]
    _step(blocks, out)
    out = sched.schedule()  # the batch sequence wants a second block: it waits, though admitted first
    assert [i.seq for i in out] == [chat] and sched.preempted == [batch]
    assert chat.status is Status.RUNNING


def test_batch_prompts_take_a_share_of_a_steps_prompt_work():
    """A step that an interactive request may arrive during is one it waits for: batch prompts get
    BACKGROUND_PROMPT_SHARE of the step's prompt work, an interactive one all of it."""
    from wafer.engine.scheduler import BACKGROUND_PROMPT_SHARE

    blocks, sched = _scheduler()
    batch = [_seq(list(range(1, 61)), background=True) for _ in range(2)]
    for s in batch:
        sched.add(s)
    # (a share of at least MIN_CHUNK tokens: the scheduler gives no prompt a smaller chunk)
    out = sched.schedule(prefill_cap=160)
    assert [(i.seq, i.count) for i in out] == [(batch[0], int(160 * BACKGROUND_PROMPT_SHARE))]
    _step(blocks, out)
    chat = _seq([5] * 60)
    sched.add(chat)
    out = sched.schedule(prefill_cap=160)
    assert [(i.seq, i.count) for i in out] == [(chat, 60)]


def test_a_step_decodes_batch_sequences_up_to_its_rows_and_one_at_least():
    blocks, sched = _scheduler(max_running=6)
    batch = [_seq([1, 2, 3], background=True) for _ in range(4)]
    chat = [_seq([4, 5, 6]) for _ in range(2)]
    for s in [*batch, *chat]:
        sched.add(s)
    _step(blocks, sched.schedule())  # every prompt read: each has its first token
    out = sched.schedule()
    assert [i.seq for i in out] == [*chat, *batch]  # no bound: every decoder
    _step(blocks, out)
    out = sched.schedule(decode_rows=3)
    assert [i.seq for i in out] == [*chat, batch[0]]  # the interactive ones, then batch ones to 3 rows
    _step(blocks, out)
    out = sched.schedule(decode_rows=1)
    assert [i.seq for i in out] == [*chat, batch[0]]  # past the bound already: one batch sequence moves
    assert all(s.status is Status.RUNNING and s.slot is not None for s in batch)  # the rest keep their blocks


def test_the_decoders_beside_interactive_work_fit_a_share_of_the_step(monkeypatch):
    from wafer.engine import background_pace
    from wafer.engine.background_pace import BackgroundPace
    from wafer.engine.step_cost import StepCost

    cost = StepCost(decay=0.9)  # as the pace fits decode steps: one "token" a step, its rows as "positions"
    for rows in (16, 1, 4, 16, 2, 8):
        cost.observe(1, rows, 0.004 + 0.001 * rows)
    fixed, per_row = cost.coefficients()
    assert abs(fixed - 0.004) < 1e-9 and abs(per_row - 0.001) < 1e-9
    same = StepCost(decay=0.9)
    for _ in range(3):
        same.observe(1, 16, 0.020)
    assert same.coefficients() == pytest.approx((0.020, 0.0))  # rows never varied: their mean, no per-row cost

    clock = [100.0]
    monkeypatch.setattr(background_pace.time, "monotonic", lambda: clock[0])
    pace = BackgroundPace()
    assert pace.rows() is None  # nothing learned, no interactive request: no bound
    pace.cost = cost
    assert pace.rows() is None  # still no interactive request
    pace.interactive()
    assert pace.rows() == 2  # 1.5 times the fixed 4 ms: 2 rows of 1 ms
    clock[0] += background_pace.INTERACTIVE_RECENT_SECONDS + 1
    assert pace.rows() is None  # none lately: batch work decodes all it runs
    pace.interactive()
    pace.cost = same
    assert pace.rows() == 1  # rows not told apart: one, whose steps then tell them apart
