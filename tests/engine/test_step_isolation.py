"""A failure that belongs to one sequence ends that sequence alone; the others in the step go on
and produce exactly what they would have produced without it."""

from __future__ import annotations

import threading

import httpx
import pytest

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.model_runner import ModelRunner
from wafer.engine.sampler import Sampler
from wafer.engine.sequence import SamplingParams

MARK = 4242  # the seed that marks the request whose rows fail


def _params(seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, seed=seed)


def _faulty_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Sampler.__call__

    def sampler(self, logits, seqs):  # type: ignore[no-untyped-def]
        if any(s.params.seed == MARK for s in seqs):
            raise RuntimeError("a bad row")
        return real(self, logits, seqs)

    monkeypatch.setattr(Sampler, "__call__", sampler)


def _faulty_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ModelRunner.run

    def run(self, scheduled, *a, **kw):  # type: ignore[no-untyped-def]
        if any(item.seq.params.seed == MARK for item in scheduled):
            raise RuntimeError("a bad forward")
        return real(self, scheduled, *a, **kw)

    monkeypatch.setattr(ModelRunner, "run", run)


def _run_together(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):  # type: ignore[no-untyped-def]
    seqs = [engine.add(p, sp) for p, sp in zip(prompts, params)]
    outputs = []
    while engine.has_work:
        outputs.extend(engine.step())
    return seqs, outputs


@pytest.mark.parametrize("fault", [_faulty_sampler, _faulty_forward], ids=["sampling", "forward"])
def test_one_failing_sequence_does_not_fail_the_others(smollm, monkeypatch, fault):
    tok = smollm.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("The sky is", "One, two, three,", "Hello")]
    alone = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=256, prefix_caching=False))
    expected = [s.output_ids for s in alone.generate([prompts[0], prompts[2]], _params())]

    fault(monkeypatch)
    engine = LLMEngine(smollm, EngineConfig(max_running=4, max_model_len=256, prefix_caching=False))
    seqs, outputs = _run_together(engine, prompts, [_params(), _params(MARK), _params()])
    assert [seqs[0].output_ids, seqs[2].output_ids] == expected
    assert [s.finish_reason for s in seqs] == ["length", "error", "length"]
    errors = [o for o in outputs if o.error is not None]
    assert [o.seq_id for o in errors] == [seqs[1].seq_id] and "RuntimeError" in errors[0].error
    assert engine.blocks.num_used == 0  # every slot back, the failed one's too
    assert not engine.seqs  # the failed one released too


def test_server_fails_one_request_and_answers_the_other(server, monkeypatch):
    _faulty_sampler(monkeypatch)
    results: dict[str, httpx.Response] = {}

    def ask(name: str, **kw) -> None:  # type: ignore[no-untyped-def]
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count to ten."}],
                "max_tokens": 24, "ignore_eos": True, "temperature": 0, **kw}
        results[name] = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)

    threads = [threading.Thread(target=ask, args=("bad",), kwargs={"seed": MARK}),
               threading.Thread(target=ask, args=("good",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["bad"].status_code == 500
    assert results["bad"].json()["error"]["type"] == "server_error"
    good = results["good"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 24
    server.wait_idle()
    assert server.engine.num_running == 0 and not server.engine.seqs
