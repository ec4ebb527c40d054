"""Pipeline stages (engine/pipeline/): greedy outputs through 2 and 3 stage processes equal one
process's, token for token, on the float32 path and the default (fused q8) path, for concurrent
requests of mixed lengths, with prefix caching, speculation and aborts; a stage killed mid-step
fails the running requests and the stages come back."""

from __future__ import annotations

import itertools
import os
import random
import signal
import time

import pytest
from gguf import GGMLQuantizationType as Q

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.models.loader import load_model
from wafer.models.stage import split_layers

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.tiny import hf_to_gguf, make_hf_model

    d = make_hf_model(tmp_path_factory.mktemp("pp-hf"), "qwen2", num_hidden_layers=6, vocab_size=49152)
    return hf_to_gguf(d, tmp_path_factory.mktemp("pp") / "tiny.gguf", Q.Q8_0)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    out = []
    for i in range(n):
        length = [6, 90, 23, 130, 3, 47, 75, 12][i % 8]
        own = [rng.randrange(3, 49000) for _ in range(length)]
        out.append(shared + own if i % 3 == 0 else own)  # some share a prefix of 40 tokens
    return out


def _engine(path, compute: str, pp: int, **kw) -> LLMEngine:
    cfg = EngineConfig(pipeline_parallel=pp, max_running=8, max_batched_tokens=64, pipeline_timeout=60, **kw)
    return LLMEngine(load_model(str(path), compute=compute), cfg)


def _generate(engine: LLMEngine, prompts: list[list[int]], abort_after: int | None = None):
    """Greedy outputs of each prompt, run together; with abort_after, prompt 1 is aborted once that
    many steps have gone (while its step may be in flight)."""
    # The first asks for logprobs: its steps bring back logits; the others' only their argmax.
    seqs = [engine.add(p, SamplingParams(max_tokens=8 + 4 * (i % 4), temperature=0, ignore_eos=True,
                                         logprobs=2 if i == 0 else None))
            for i, p in enumerate(prompts)]
    for steps in itertools.count():
        if not engine.has_work:
            break
        if steps == abort_after:
            engine.abort(seqs[1].seq_id)
        engine.step()
    while engine.executor.in_flight:  # what is still in flight for an aborted sequence drains
        engine.step()
    return [s.tokens[s.num_prompt:] for s in seqs], seqs


def test_split_layers_balances_contiguous_ranges():
    rng = random.Random(1)
    for _ in range(200):
        n, stages = rng.randrange(1, 9), rng.randrange(1, 5)
        costs, head = [rng.randrange(1, 10) for _ in range(n)], rng.randrange(0, 30)
        if stages > n:
            with pytest.raises(ValueError):
                split_layers(costs, head, stages)
            continue
        ranges = split_layers(costs, head, stages)
        assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == n
        assert all(a < b for a, b in ranges)

        def worst(rs):
            return max(sum(costs[a:b]) + (head if b == n else 0) for a, b in rs)

        best = min(worst(list(zip((0,) + cuts, cuts + (n,))))
                   for cuts in itertools.combinations(range(1, n), stages - 1))
        assert worst(ranges) == best


@pytest.mark.parametrize("compute", ["f32", "auto"])
def test_pipeline_outputs_equal_one_process(tiny_gguf, compute):
    prompts = _prompts(8)
    single = _engine(tiny_gguf, compute, 1)
    want, _ = _generate(single, prompts)
    again, _ = _generate(single, prompts[:3])  # the same prompts again: served from the prefix cache
    assert again == want[:3]
    for pp in (2, 3):
        engine = _engine(tiny_gguf, compute, pp)
        pids = engine.pipeline.stage_pids()
        try:
            assert engine.pipeline is not None and len(engine.pipeline.procs) == pp - 1
            got, seqs = _generate(engine, prompts)
            assert got == want, f"{pp} stages on {compute}"
            assert len(seqs[0].logprobs) == len(got[0]) and all(len(lp.top) == 2 for lp in seqs[0].logprobs)
            hits = engine.blocks.prefix_hit_tokens
            got, seqs = _generate(engine, prompts[:3])
            assert got == want[:3]
            assert engine.blocks.prefix_hit_tokens > hits and all(s.num_cached_prompt > 0 for s in seqs)
            assert engine.stats.max_batch_size < len(prompts)  # the batch was shared among steps in flight
        finally:
            engine.close()
        assert not any(_alive(pid) for pid in pids)


def test_pipeline_speculation_and_abort():
    """On SmolLM2 (a random model would not repeat its prompt, so no draft would be accepted)."""
    from wafer.models.loader import default_model_path

    tok = load_model(compute="auto").tokenizer
    text = "one two three four five six seven eight nine ten. " * 4
    prompts = [tok.encode(text), tok.encode("The capital of France is"), tok.encode("a b c d e f g a b c d e f g a b c")]
    spec = SpeculativeConfig(method="ngram", num_tokens=3, adaptive=False)
    single = _engine(default_model_path(), "auto", 1, speculative=spec)
    want, _ = _generate(single, prompts)
    engine = _engine(default_model_path(), "auto", 2, speculative=spec)
    try:
        got, _ = _generate(engine, prompts)
        assert got == want
        assert engine.stats.spec.draft_tokens > 0 and engine.stats.spec.accepted_tokens > 0
        got, seqs = _generate(engine, prompts, abort_after=3)
        assert seqs[1].finish_reason == "abort"
        assert got[0] == want[0] and got[2] == want[2]
        assert engine.blocks.usage == 0 and not engine.scheduler.running
    finally:
        engine.close()


def test_killed_stage_fails_running_requests_then_comes_back(tiny_gguf):
    prompts = _prompts(4)
    single = _engine(tiny_gguf, "auto", 1)
    want, _ = _generate(single, prompts)
    engine = _engine(tiny_gguf, "auto", 3)
    pipe = engine.pipeline
    old = pipe.stage_pids()
    try:
        seqs = [engine.add(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)) for p in prompts]
        for _ in range(4):
            engine.step()
        os.kill(old[0], signal.SIGKILL)  # the middle stage
        outputs, deadline = [], time.monotonic() + 30
        while not all(s.finished for s in seqs):
            assert time.monotonic() < deadline, "running sequences did not fail"
            outputs += engine.step()
        assert {o.seq_id for o in outputs if o.error} == {s.seq_id for s in seqs}
        assert all(o.error.startswith("StageFailure") for o in outputs if o.error)
        snap = engine.snapshot()
        assert snap.fault is not None and "stage" in snap.fault
        deadline = time.monotonic() + 60
        while not pipe.ready:
            assert time.monotonic() < deadline, "the stages did not come back"
            time.sleep(0.1)
        assert engine.snapshot().fault is None and pipe.restarts == 1
        assert all(not _alive(pid) for pid in old)  # the survivor of the old group was stopped too
        got, _ = _generate(engine, prompts)
        assert got == want
        # A stage that hangs (stopped) is caught by the timeout, and replaced too.
        pipe.timeout = 3
        hung = pipe.stage_pids()[1]
        seq = engine.add(prompts[0], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        engine.step()
        os.kill(hung, signal.SIGSTOP)
        started, outputs = time.monotonic(), []
        while not seq.finished:
            assert time.monotonic() - started < 30, "the hung stage was not noticed"
            outputs += engine.step()
        assert [o.seq_id for o in outputs if o.error] == [seq.seq_id]
        assert pipe.restarts == 2 and not _alive(hung)
        deadline = time.monotonic() + 60
        while not pipe.ready:
            assert time.monotonic() < deadline, "the stages did not come back"
            time.sleep(0.1)
        got, _ = _generate(engine, prompts[:1])
        assert got == want[:1]
        old += [hung]
    finally:
        engine.close()
    assert all(not _alive(pid) for pid in pipe.stage_pids() + old)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, only not yet reaped
        return f.read().split()[2] != "Z"


def test_a_step_that_raises_on_a_stage_fails_only_its_sequence(tiny_gguf):
    """A step that raises on a later stage comes back as an error, not a dead pipeline; its sequences
    go again one by one, and only the one that fails alone fails. Here the second stage's KV pool is
    made smaller than rank 0's, so that a sequence whose blocks lie past its end fails there only."""
    import dataclasses

    rng = random.Random(5)
    # Two blocks each, in slots 0 to 3: each slot's blocks start at its home in the pool (slot x
    # home_stride, block_pool.py), so a stage-1 pool of 3 strides holds all but the last sequence's.
    prompts = [[rng.randrange(3, 49000) for _ in range(20)] for _ in range(4)]
    single = _engine(tiny_gguf, "auto", 1, prefix_caching=False)
    want, _ = _generate(single, prompts)
    engine = _engine(tiny_gguf, "auto", 2, prefix_caching=False)
    pipe = engine.pipeline
    try:
        pipe.close()
        stride = engine.blocks.groups[0].home_stride
        assert stride >= 2
        pipe.spec = dataclasses.replace(pipe.spec, num_blocks=3 * stride)
        pipe.start()
        seqs = [engine.add(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts]
        outputs = []
        while engine.has_work or engine.executor.in_flight:
            outputs += engine.step()
        for seq, tokens in zip(seqs[:3], want):
            assert seq.finish_reason == "length" and seq.tokens[seq.num_prompt:] == tokens[:8]
        assert seqs[3].finish_reason == "error"
        errors = [o.error for o in outputs if o.error]
        assert len(errors) == 1 and errors[0].startswith("StageError: stage 1:"), errors
        assert pipe.restarts == 0 and pipe.ready  # the pipeline went on
    finally:
        engine.close()
