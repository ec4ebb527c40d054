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
    with caplog.at_level(logging.INFO, logger="wafer.engine"):
        while engine.poll():
            pass
    assert [(s.kind, s.sequences, s.prompt_tokens) for s in seen] == [("prompt", 1, 4), ("decode", 1, 0), ("decode", 1, 0)]
    assert all(0 < s.forward_seconds <= s.seconds < 10 for s in seen)
    assert all(s.mask_seconds == 0.0 for s in seen)  # no grammar: nothing masked
    logged = [r.getMessage() for r in caplog.records if "step took" in r.getMessage()]
    assert len(logged) == 3 and logged[0].startswith("a prompt step took") and "4 prompt tokens" in logged[0]
    assert "grammars' masks 0 ms" in logged[0]
