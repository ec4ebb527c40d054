"""AsyncEngine driven by hand (poll, as run_engines does): what each step puts into the requests'
queues, shared queues tagged per request, and aborts."""

from __future__ import annotations

import asyncio
import logging

from wafer.engine import async_engine
from wafer.engine.async_engine import AsyncEngine
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams, SequenceOutput
from wafer.models.loader import load_model


def drain(q: asyncio.Queue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_a_step_puts_every_request_output_into_its_queue_tagged_when_shared(tiny_dir):
    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=4, max_model_len=128)))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    shared: asyncio.Queue = asyncio.Queue()
    first = engine.submit([1, 5, 9, 13], params, queue=shared, key=0)
    second = engine.submit([1, 7], params, queue=shared, key=1)
    alone = engine.submit([1, 2, 3], params)
    assert first.queue is second.queue is shared and alone.queue is not shared

    per_step: list[list] = []
    while engine.poll():
        per_step.append(drain(shared))
        got = drain(alone.queue)
        assert len(got) == 1 and isinstance(got[0], SequenceOutput)  # untagged
    assert len(per_step) == 3  # both prompts fit the first step; every step advances both choices
    for items in per_step:
        assert sorted(key for key, _ in items) == [0, 1]
        assert all(isinstance(out, SequenceOutput) for _, out in items)
    assert all(out.finished for _, out in per_step[-1])
    assert engine.idle and engine.engine.blocks.num_used == 0


def test_abort_ends_a_request_before_the_next_step(tiny_dir):
    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=2, max_model_len=128)))
    req = engine.submit([1, 5, 9], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert engine.poll() and engine.num_running == 1
    engine.abort(req)
    assert not engine.poll()  # the abort is taken first, so nothing is left to step
    assert engine.num_running == 0 and engine.engine.blocks.num_used == 0


def test_each_step_is_timed_for_its_observers_and_a_slow_one_is_logged(tiny_dir, monkeypatch, caplog):
    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=2, max_model_len=128)))
    seen: list[async_engine.StepTiming] = []
    engine.step_observers.append(seen.append)
    engine.submit([1, 5, 9, 13], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    monkeypatch.setattr(async_engine, "SLOW_STEP_SECONDS", 0.0)  # every step counts as slow
    with caplog.at_level(logging.DEBUG, logger="wafer.engine"):
        while engine.poll():
            pass
    assert [(s.kind, s.sequences, s.prompt_tokens) for s in seen] == [("prompt", 1, 4), ("decode", 1, 0), ("decode", 1, 0)]
    assert all(0 < s.forward_seconds <= s.seconds < 10 for s in seen)
    assert all(s.mask_seconds == 0.0 for s in seen)  # no grammar: nothing masked
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if "step took" in r.getMessage()]
    # The first at info; the two within SLOW_STEP_INFO_SECONDS of it at debug.
    assert [level for level, _ in logged] == [logging.INFO, logging.DEBUG, logging.DEBUG]
    assert logged[0][1].startswith("a prompt step took") and "4 prompt tokens" in logged[0][1]
    assert "grammars' masks 0 ms" in logged[0][1]
    assert logged[1][1].startswith("a decode step took")


def test_slow_steps_reach_info_at_most_once_per_interval_with_a_count_of_the_rest(caplog):
    now = [100.0]
    slow_log = async_engine.SlowStepLog(interval=10.0, clock=lambda: now[0])

    def step(ms: float, at: float) -> None:
        now[0] = at
        slow_log(async_engine.StepTiming(ms / 1000, 8, 0, forward_seconds=ms / 2000))

    with caplog.at_level(logging.DEBUG, logger="wafer.engine"):
        step(50, 100.0)  # not slow: no line
        step(150, 100.5)  # the first slow step: at info
        for k in range(30):  # 30 within the next 10 s: each at debug
            step(120 + k, 101 + k * 0.3)
        step(200, 110.4)  # still within 10 s of the line at info
        step(130, 110.5)  # 10 s after it: at info again, with the 31 left out
        step(140, 115.0)
        step(110, 121.0)  # one left out since: counted
        step(105, 131.0)  # none left out since: no count
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    info = [m for level, m in lines if level == logging.INFO]
    assert len(lines) == 36 and len(info) == 4
    assert info[0].startswith("a decode step took 150 ms (8 sequences, 0 prompt tokens; the forward pass 75 ms")
    assert "more slow steps" not in info[0]
    assert info[1].startswith("a decode step took 130 ms") and info[1].endswith(
        "[and 31 more slow steps since the last such line, the longest 200 ms; each at debug]")
    assert info[2].startswith("a decode step took 110 ms")
    assert info[2].endswith("[and 1 more slow step since the last such line, the longest 140 ms; each at debug]")
    assert "more slow step" not in info[3]
    debug = [m for level, m in lines if level == logging.DEBUG]
    assert debug[0].startswith("a decode step took 120 ms") and "more slow steps" not in debug[0]


def test_slow_steps_log_nothing_at_info_while_held_back(caplog):
    """With the logger at info, the held steps cost no line at all (3,700 lines in 25 minutes were the
    motive): three slow steps a second for a minute make six lines."""
    now = [0.0]
    slow_log = async_engine.SlowStepLog(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="wafer.engine"):
        for k in range(180):
            now[0] = k / 3
            slow_log(async_engine.StepTiming(0.25, 4, 0))
    assert len(caplog.records) == 6 and all(r.levelno == logging.INFO for r in caplog.records)
    assert "[and 29 more slow steps" in caplog.records[1].getMessage()


def test_batch_work_is_stopped_on_shutdown_with_nothing_delivered_as_an_answer(tiny_dir):
    """Batch lines are not drained nor cut short on shutdown (stop_background, finish_all): they get
    EngineStopped and run again after a restart; interactive requests go on, or end with what they have."""
    from wafer.engine.async_engine import EngineStopped

    engine = AsyncEngine(LLMEngine(load_model(str(tiny_dir)), EngineConfig(max_running=4, max_model_len=128)))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    chat = engine.submit([1, 5, 9], params)
    line = engine.submit([1, 7, 7], params, background=True)
    other = engine.submit([1, 8, 8], params, background=True)
    for _ in range(3):
        engine.poll()
    assert len(drain(line.queue)) > 0  # it ran beside the interactive one once its prompt was read
    engine.stop_background()
    engine.poll()
    assert isinstance(drain(line.queue)[-1], EngineStopped) and isinstance(drain(other.queue)[-1], EngineStopped)
    assert engine.num_running == 1 and all(isinstance(o, SequenceOutput) for o in drain(chat.queue))
    late = engine.submit([1, 6, 6], params, background=True)
    engine.poll()
    engine.poll()
    engine.finish_all()
    engine.poll()
    assert drain(chat.queue)[-1].finished
    assert isinstance(drain(late.queue)[-1], EngineStopped)
    assert engine.idle
