"""Speculative decoding: greedy output identical to plain decoding (n-gram and draft model, alone
and batched), sampled output distributed as the target's, and the bookkeeping that makes it so."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap

import pytest
import torch

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.draft_length import DraftLength
from wafer.engine.speculative.ngram import NgramProposer
from wafer.engine.speculative.speculator import lookup_on_request
from wafer.engine.speculative.stats import SpecStats
from wafer.engine.speculative.verification import rejection_sample
from wafer.models.loader import load_model


def engine(loaded, spec: str | SpeculativeConfig = "off", k: int = 5, draft=None, **kw) -> LLMEngine:
    sc = spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig.parse(spec, k, "fixed")
    cfg = EngineConfig(max_running=kw.pop("max_running", 4), max_model_len=2048, speculative=sc, **kw)
    return LLMEngine(loaded, cfg, draft=draft)


def rewrite_prompt(loaded) -> list[int]:
    src = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))
    text = loaded.chat_template.render(
        [{"role": "user", "content": f"Rename `chunks` to `pieces` in this code:\n```python\n{src}\n```"}],
        add_generation_prompt=True) + "```python\ndef _split(self, text):\n"
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": text}],
                                                               add_generation_prompt=True), add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    return [rewrite_prompt(smollm), chat(smollm, "List the days of the week, then list them again in reverse."),
            chat(smollm, "Write a haiku about the sea.")]


def test_parse() -> None:
    assert SpeculativeConfig.parse("ngram", 3).method == "ngram"
    d = SpeculativeConfig.parse("draft:luna", 4)
    assert (d.method, d.draft_model, d.num_tokens) == ("draft", "luna", 4)
    assert not SpeculativeConfig.parse(None).enabled
    for bad in ("draft:", "eagle", "ngram:3"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError):
        SpeculativeConfig.parse("ngram", 0)
    assert not SpeculativeConfig.parse("ngram", 3, "fixed").adaptive
    assert SpeculativeConfig.parse("ngram", 3).adaptive and SpeculativeConfig().adaptive  # the default, as the CLI's
    assert SpeculativeConfig.parse("draft:luna", 4, "adaptive").adaptive
    with pytest.raises(ValueError):
        SpeculativeConfig.parse("ngram", 3, "sometimes")


def simulate(lengths: DraftLength, step_seconds, accept: float, steps: int) -> list[int]:
    """Run the hill climb against a machine whose step over n rows takes step_seconds(n) and whose
    drafts are each kept with probability `accept` (expected tokens of a step with k proposed:
    1 + accept + ... + accept^k, no noise); the lengths it chose, in order."""
    chosen = []
    for _ in range(steps):
        k = lengths.choose()
        chosen.append(k)
        lengths.record(k, sum(accept ** i for i in range(k + 1)), step_seconds(1 + k))
    return chosen


def test_draft_length_finds_that_speculation_does_not_pay_where_rows_cost_nearly_a_step() -> None:
    # Two cores: a verified row costs half a step (compute bound), the drafts are poor.
    chosen = simulate(DraftLength(8), lambda n: 0.065 + 0.031 * (n - 1), 0.3, 120)
    assert chosen[0] == 8  # K until measured
    assert chosen[-60:].count(0) >= 45  # then plain decoding, exploring its one neighbour now and then
    assert set(chosen[-60:]) <= {0, 1}


def test_draft_length_keeps_k_where_rows_are_cheap_and_drafts_are_kept() -> None:
    # Bound by memory bandwidth: extra rows cost little; a copying answer keeps 90% of the drafts.
    chosen = simulate(DraftLength(8), lambda n: 0.065 + 0.002 * (n - 1), 0.9, 120)
    assert chosen[-60:].count(8) >= 45 and set(chosen[-60:]) <= {4, 8}


def test_draft_length_follows_a_change_of_text() -> None:
    lengths = DraftLength(8)
    cheap = lambda n: 0.065 + 0.01 * (n - 1)  # noqa: E731
    simulate(lengths, cheap, 0.95, 60)  # copying: long drafts pay
    assert lengths.best() == 8
    late = simulate(lengths, cheap, 0.05, 150)  # new text: drafts are rejected
    assert late[-50:].count(0) + late[-50:].count(1) >= 45
    assert lengths.best() in (0, 1)


def test_draft_length_learns_apart_after_kept_and_after_cut_drafts() -> None:
    # A copying answer: stretches where drafts are kept (after a draft kept whole) broken by new
    # text (after one cut short). One climb over both would sit between; two find each its own.
    lengths = DraftLength(8)
    cost = lambda n: 0.065 + 0.01 * (n - 1)  # noqa: E731
    for _ in range(40):
        for kept, accept, steps in ((True, 0.95, 12), (False, 0.1, 6)):
            for _ in range(steps):
                k = lengths.choose(1, kept)
                lengths.record(k, sum(accept ** i for i in range(k + 1)), cost(1 + k), 1, kept)
    assert lengths.best(1, kept=True) == 8
    assert lengths.best(1, kept=False) in (0, 1)


def test_the_engine_gives_the_draft_length_the_last_steps_outcome(smollm, prompts) -> None:
    """choose() hears whether the step before kept every draft whole, record() the same context."""
    spec = engine(smollm, SpeculativeConfig(method="ngram", num_tokens=4, adaptive=True))
    lengths = spec.speculator.draft_length
    assert lengths is not None
    # Drafts of 4 look best at first in both contexts, so that some are kept in part.
    lengths.by_context.update({(1, False): {4: 1e9}, (1, True): {4: 1e9}})
    steps: list[tuple[bool, int, int]] = []  # (context given, tokens drafted, kept) per step
    choose, record = lengths.choose, lengths.record
    given: list[bool] = []
    lengths.choose = lambda batch=1, kept=False: (given.append(kept), choose(batch, kept))[1]  # type: ignore[method-assign]
    contexts: list[bool] = []
    lengths.record = lambda k, tokens, seconds, batch=1, kept=False: (  # type: ignore[method-assign]
        contexts.append(kept), record(k, tokens, seconds, batch, kept))
    seq = spec.add(prompts[0], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    st = spec.stats.spec
    while not seq.finished:
        n_given, n_recorded, drafted, accepted = len(given), len(contexts), st.draft_tokens, st.accepted_tokens
        spec.step()
        if len(given) > n_given:
            steps.append((given[-1], st.draft_tokens - drafted, st.accepted_tokens - accepted))
            if len(contexts) > n_recorded:
                assert contexts[-1] == given[-1]  # measured in the context it was chosen in
    assert len(contexts) > len(steps) // 2
    for (_, drafted, accepted), (next_given, _, _) in zip(steps, steps[1:]):
        assert next_given == (drafted > 0 and accepted == drafted)
    assert {True, False} <= {c for c, _, _ in steps}  # the rewrite keeps some drafts whole, not all
    assert any(0 < accepted < drafted for _, drafted, accepted in steps)  # and some in part


def test_adaptive_ngram_greedy_equals_plain_and_learns_from_decode_steps_alone(smollm, prompts) -> None:
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = engine(smollm).generate(prompts, sp)
    spec = engine(smollm, SpeculativeConfig(method="ngram", num_tokens=8, adaptive=True))
    recorded = []
    lengths = spec.speculator.draft_length
    assert lengths is not None
    record = lengths.record
    lengths.record = lambda k, tokens, seconds, batch=1, kept=False: (  # type: ignore[method-assign]
        recorded.append((k, tokens, batch)), record(k, tokens, seconds, batch, kept))
    out = [spec.generate([p], sp)[0] for p in prompts]
    assert [s.output_ids for s in out] == [s.output_ids for s in plain]
    # Every decoding step chooses a length and is measured (120 tokens in fewer steps); prompt
    # steps do neither: a step yields between 1 and k + 1 tokens of its one sequence.
    assert 0 < len(recorded) == sum(lengths.chosen.values()) < 3 * 40
    assert all(1 <= tokens <= k + 1 and batch == 1 for k, tokens, batch in recorded)
    assert sum(tokens for _, tokens, _ in recorded) == 3 * 40 - 3  # each prompt's first token comes from its prefill
    assert (lengths.yields(1) or lengths.yields(1, kept=True)) and not lengths.yields(2)


def test_adaptive_draft_model_greedy_equals_plain(tiny_pair) -> None:
    """Steps at length 0 leave the draft behind; it catches up at its next proposal, unmeasured."""
    target, draft = tiny_pair
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = [[1, 3, 4, 5], [1, 9, 9, 8, 7, 6, 5, 4]]
    plain = engine(target).generate(prompts, sp)
    spec = engine(target, SpeculativeConfig(method="draft", num_tokens=4, draft_model="d", adaptive=True), draft=draft)
    spec.speculator.draft_length.by_context[(1, False)] = {0: 1e9}  # type: ignore[union-attr]  # plain decoding looks best at first
    fed = []
    run = spec.speculator.proposer.runner.run
    spec.speculator.proposer.runner.run = lambda items, *a, **kw: (fed.append([i.count for i in items]), run(items, *a, **kw))[1]
    out = [spec.generate([p], sp)[0] for p in prompts]
    assert [s.output_ids for s in out] == [s.output_ids for s in plain]
    assert spec.stats.spec.draft_tokens > 0
    # After plain steps the draft catches up in a call of its own, then proposes from one token.
    catch_ups = [i for i, f in enumerate(fed) if f[0] >= 2 and i + 1 < len(fed) and fed[i + 1] == [1]]
    assert catch_ups
    chosen = spec.speculator.draft_length.chosen  # type: ignore[union-attr]
    assert chosen[0] > 0 and sum(n for k, n in chosen.items() if k > 0) > 0  # both kinds of step ran
    assert 1 in spec.speculator.draft_length.yields(1)  # type: ignore[union-attr]  # a length explored after plain steps is measured


def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    from wafer.engine.sequence import Sequence

    prop = NgramProposer(SpeculativeConfig(method="ngram", ngram_max=3, ngram_min=2))
    seq = Sequence([5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4], SamplingParams())
    seq.tokens += [1, 6, 7]  # suffix (6, 7) last occurred before 3, 4; (1, 6, 7) never did
    assert prop.propose([seq], [3])[0].tokens == [3, 4]  # a 2-token match proposes 2
    seq.tokens += [3, 4, 1, 6, 7]  # (4, 1, 6, 7) is longer than ngram_max; (1, 6, 7) matches whole
    assert prop.propose([seq], [4])[0].tokens == [3, 4, 1, 6]
    seq.tokens += [42]
    assert prop.propose([seq], [3])[0].tokens == []  # no earlier 42
    seq.tokens += [9, 1]  # (9, 1) followed by 2, 6, 7
    assert prop.propose([seq], [2])[0].tokens == [2, 6]


def test_ngram_lookup_goes_on_repeating_a_match_that_runs_into_the_suffix() -> None:
    from wafer.engine.sequence import Sequence

    prop = NgramProposer(SpeculativeConfig(method="ngram", ngram_max=4, ngram_min=2))
    # ... 7, 8, 9, 7, 8, 9, 7, 8: the latest earlier (7, 8) ends 3 tokens back, so only 9, 7, 8
    # follow it; the text repeats with period 3 and the proposal goes on with it.
    seq = Sequence([1, 2, 7, 8, 9, 7, 8, 9, 7, 8], SamplingParams())
    assert prop.propose([seq], [8])[0].tokens == [9, 7, 8, 9, 7, 8, 9, 7]
    # A run of one token (period 1), as indentation is.
    seq = Sequence([3, 4, 0, 0, 0, 0, 0], SamplingParams())
    assert prop.propose([seq], [5])[0].tokens == [0, 0, 0, 0, 0]
    # A match far enough back is cut to k as before, with nothing repeated.
    seq = Sequence([3, 4, 5, 6, 1, 2, 3, 4, 5, 6], SamplingParams())
    assert prop.propose([seq], [3])[0].tokens == [1, 2, 3]


@pytest.mark.parametrize("max_tokens", [7, 48])
def test_ngram_greedy_equals_plain_alone_and_batched(smollm, prompts, max_tokens) -> None:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    plain = engine(smollm).generate(prompts, sp)
    spec = engine(smollm, "ngram", k=6)
    batched = spec.generate(prompts, sp)
    alone = [spec.generate([p], sp)[0] for p in prompts]
    for a, b, c in zip(plain, batched, alone):
        assert b.output_ids == a.output_ids and c.output_ids == a.output_ids
        assert b.text == a.text and b.finish_reason == a.finish_reason
    assert spec.stats.spec.accepted_tokens > 0  # speculation really ran and was kept
    if max_tokens > 20:  # long enough for the rewrite to copy its input
        assert spec.stats.spec.mean_acceptance_length > 1.5


def test_prompt_lookup_asked_for_by_a_request_where_the_engine_does_not_speculate(smollm, prompts) -> None:
    """`prompt_lookup` drafts that sequence by n-gram lookup on an engine started without
    speculation; the sequences beside it that did not ask decode as before, and all are as plain."""
    sp = SamplingParams(max_tokens=48, temperature=0)
    plain = engine(smollm)
    want = plain.generate(prompts, sp)
    assert plain.stats.spec.drafts == 0  # none asked: nothing proposed
    e = engine(smollm)
    proposed_for: set[int] = set()
    proposer = e.speculator.proposer
    assert proposer is not None
    propose = proposer.propose
    proposer.propose = lambda seqs, limits: (proposed_for.update(s.seq_id for s in seqs), propose(seqs, limits))[1]  # type: ignore[method-assign]
    params = [dataclasses.replace(sp, prompt_lookup=True), sp, sp]
    got = e.generate(prompts, params)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert proposed_for == {got[0].seq_id}
    lengths = e.speculator.draft_length
    assert e.stats.spec.accepted_tokens > 0 and lengths is not None and sum(lengths.chosen.values()) > 0


def test_prompt_work_leaves_room_for_the_drafts_a_step_may_verify(smollm, prompts) -> None:
    """Drafts are attached after the prompt chunks are chosen, and their rows lengthen a step paced
    to a time budget (every stream waits that long): the prompt work shrinks by K rows, each at its
    position, for each decoder that may draft; by nothing for one that did not ask."""
    e = engine(smollm)
    e.budget.cap = lambda: (400, 0.01)  # as if the step cost had been measured
    seen: list[tuple[int | None, int | None]] = []
    schedule = e.scheduler.schedule
    plain = e.add(prompts[1], SamplingParams(max_tokens=12, temperature=0))
    looked = e.add(prompts[2], SamplingParams(max_tokens=12, temperature=0, prompt_lookup=True))

    def spy(cap, *a, **kw):  # type: ignore[no-untyped-def]
        decoding = looked.num_cached == len(looked.tokens) - 1 and not looked.finished
        seen.append((cap, len(looked.tokens) if decoding else None))
        return schedule(cap, *a, **kw)

    e.scheduler.schedule = spy  # type: ignore[method-assign]
    while not (plain.finished and looked.finished):
        e.step()
    k = e.config.speculative.num_tokens
    assert seen[0] == (400, None)  # nothing decodes yet: the whole budget goes to the prompts
    drafting = [(cap, n) for cap, n in seen if n is not None]
    assert drafting and all(cap == int(400 - k * (1 + 0.01 * n)) for cap, n in drafting)


def test_prompt_lookup_is_not_offered_through_pipeline_stages(smollm) -> None:
    # Stages size their buffers without drafts; the request's wish is an optimisation, so it is
    # ignored there rather than refused. (The stages are not started: the check comes first.)
    cfg = EngineConfig(max_running=2, max_model_len=256, pipeline_parallel=2)
    assert lookup_on_request(cfg.speculative, cfg.pipeline_parallel) is False
    assert lookup_on_request(SpeculativeConfig(), 1) is True
    assert lookup_on_request(SpeculativeConfig.parse("ngram", 3), 1) is False


def test_ngram_greedy_with_penalties_stop_strings_and_logprobs(smollm, prompts) -> None:
    sp = SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.3, logprobs=2, stop=["return"])
    a = engine(smollm).generate(prompts, sp)
    spec = engine(smollm, "ngram", k=4)
    b = spec.generate(prompts, sp)
    for x, y in zip(a, b):
        assert y.output_ids == x.output_ids and y.text == x.text and y.finish_reason == x.finish_reason
        assert [lp.token_id for lp in y.logprobs] == [lp.token_id for lp in x.logprobs]
        assert [lp.logprob for lp in y.logprobs] == pytest.approx([lp.logprob for lp in x.logprobs], abs=1e-3)
    assert spec.stats.spec.drafts > 0


def test_ngram_on_the_fused_q4_path_equals_plain(prompts) -> None:
    """q4's int8 activations turn any change of arithmetic into noise-sized logit changes; the fused
    step computes each token alone, so verifying a draft gives bitwise what decoding it would. (A
    step that mixes a long prompt chunk with decodes runs the Python model, so batched q4 output
    depends on the batch's timing at that noise level, as in engines without batch-invariant
    kernels; hence each prompt alone here.)"""
    q4 = load_model(compute="q4")
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain, spec = engine(q4), engine(q4, "ngram", k=6)
    for p in prompts:
        assert spec.generate([p], sp)[0].output_ids == plain.generate([p], sp)[0].output_ids
    assert spec.stats.spec.accepted_tokens > 0


def test_draft_model_of_itself_is_always_accepted(smollm, prompts) -> None:
    """The target drafting for itself proposes exactly its own greedy tokens: every draft is kept,
    which only holds if the draft's KV cache follows the accepted sequence step by step."""
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = engine(smollm).generate(prompts, sp)
    spec = engine(smollm, "draft:self", k=4, draft=smollm)
    out = spec.generate(prompts, sp)
    assert [s.output_ids for s in out] == [s.output_ids for s in plain]
    st = spec.stats.spec
    assert st.acceptance_rate > 0.95, st


def test_the_draft_computes_the_prompt_with_the_target_chunk_by_chunk(smollm, prompts) -> None:
    """The draft's prompt work is done in the prompt's steps (part of the time to the first token),
    so the first proposal feeds it one token rather than the whole prompt."""
    spec = engine(smollm, "draft:self", k=4, draft=smollm, max_batched_tokens=64)
    fed = []
    run = spec.speculator.proposer.runner.run
    spec.speculator.proposer.runner.run = lambda items, *a, **kw: (fed.append([i.count for i in items]), run(items, *a, **kw))[1]
    seq = spec.add(prompts[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    n = len(prompts[0])
    assert n > 128 and n % 64 > 1  # a last chunk of one token would be decoded, not prefilled
    while not seq.output_ids:  # the prompt's steps: 64-token chunks, the draft following each
        spec.step()
    assert spec.speculator.proposer.cached[seq.seq_id] == n
    assert fed == [[64]] * (n // 64) + ([[n % 64]] if n % 64 else [])
    fed.clear()
    spec.step()  # the first proposal: the target's first token, then one token a draft step
    assert fed == [[1]] * 4
    while not seq.finished:
        spec.step()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target and a different draft with a 16-token vocabulary (sharply peaked, unlike each other)."""
    from tests.tiny import make_hf_model

    small = dict(vocab_size=16, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, initializer_range=0.5)
    target = load_model(str(make_hf_model(tmp_path_factory.mktemp("target"), seed=1, **small)))
    draft = load_model(str(make_hf_model(tmp_path_factory.mktemp("draft"), seed=2, **small)))
    return target, draft


def test_draft_model_greedy_equals_plain(tiny_pair) -> None:
    target, draft = tiny_pair
    prompts = [[1, 3, 4, 5], [1, 9, 9, 8, 7, 6, 5, 4], [1, 2]]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = engine(target).generate(prompts, sp)
    spec = engine(target, "draft:d", k=3, draft=draft)
    assert [s.output_ids for s in spec.generate(prompts, sp)] == [s.output_ids for s in plain]
    assert [spec.generate([p], sp)[0].output_ids for p in prompts] == [s.output_ids for s in plain]
    st = spec.stats.spec
    assert 0 < st.accepted_tokens < st.draft_tokens  # some kept, some rejected: both paths ran


def test_draft_with_other_tokenizer_is_refused(smollm, tiny_pair) -> None:
    with pytest.raises(ValueError, match="tokenizers differ"):
        engine(smollm, "draft:tiny", draft=tiny_pair[0])
    with pytest.raises(ValueError, match="needs a draft model"):
        engine(smollm, "draft:missing")


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Draw proposals from q, keep or replace them: the result must be distributed as p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.00, 0.15, 0.20, 0.10, 0.15, 0.05])
    q = torch.tensor([0.30, 0.05, 0.20, 0.05, 0.10, 0.10, 0.10, 0.10])
    n = 40_000
    # Bound: with 8 categories and 40k draws the expected total variation is about 0.006.
    counts = torch.zeros(8)
    for d in torch.multinomial(q, n, replacement=True, generator=gen).tolist():
        counts[rejection_sample(p, [d], [q], gen)[0]] += 1
    assert _tv(counts / n, p) < 0.015
    # Deterministic proposals (n-gram): always proposing token 4.
    counts.zero_()
    for _ in range(n):
        counts[rejection_sample(p, [4], None, gen)[0]] += 1
    assert _tv(counts / n, p) < 0.015


@torch.inference_mode()
def _marginals(loaded, prompt: list[int], depth: int, temperature: float = 1.0) -> list[torch.Tensor]:
    """The target's distribution of each of the first `depth` sampled tokens (at `temperature`), by
    summing over the paths of earlier tokens (a vocabulary of 16)."""
    eng = engine(loaded, max_running=1)

    def next_probs(ids: list[int]) -> torch.Tensor:
        seq = eng.add(ids, SamplingParams(max_tokens=1, temperature=0))
        logits = eng.runner.run(eng.scheduler.schedule())
        eng.abort(seq.seq_id)
        return (logits[-1] / temperature).softmax(-1)

    paths = {(): 1.0}  # earlier tokens -> their probability
    out = []
    for _ in range(depth):
        marginal = torch.zeros(16)
        nxt = {}
        for path, weight in paths.items():
            p = next_probs(prompt + list(path))
            marginal += weight * p
            nxt.update({path + (t,): weight * float(p[t]) for t in range(16)})
        out.append(marginal)
        # Paths under 1e-6 are left out: at most 16**3 of them, 0.004 of probability in all.
        paths = {k: w for k, w in nxt.items() if w > 1e-6}
    return out


PROMPT = [1, 3, 4, 3, 4, 3]  # repetitive, so the n-gram proposer has something to propose


@pytest.fixture(scope="module")
def target_marginals(tiny_pair) -> list[torch.Tensor]:
    return _marginals(tiny_pair[0], PROMPT, 4)


@pytest.mark.parametrize("method", ["draft:d", "ngram"])
def test_sampled_speculation_follows_the_target_distribution(tiny_pair, target_marginals, method) -> None:
    """Rejection sampling makes every drafted token distributed as the target's own sampling would
    be. Its random draws differ from plain sampling's (a seed gives other tokens), so the property
    to test is the distribution, at each position: the first token comes from the prompt's prefill
    (no draft), and every later one from a step that verified a draft (kept, or replaced after a
    rejection), at the first draft position or, once the one before was kept, a later one."""
    target, draft = tiny_pair
    want = target_marginals
    assert _tv(want[0], _marginals(draft, PROMPT, 1)[0]) > 0.2  # the draft is wrong often enough to test rejection
    n = 3000
    # Every sequence speculates (max_running 100); n-gram matches of one token propose often here.
    spec = SpeculativeConfig.parse(method, 3)
    spec.max_running, spec.ngram_min = 100, 1
    eng = engine(target, spec, draft=draft if method != "ngram" else None, max_running=100, seed=0)
    counts = torch.zeros(4, 16)
    sp = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    for _ in range(n // 100):
        for s in eng.generate([PROMPT] * 100, sp):
            for pos in range(4):
                counts[pos, s.output_ids[pos]] += 1
    st = eng.stats.spec
    assert st.drafts > n // 5 and 0 < st.accepted_tokens < st.draft_tokens
    # A kept first draft token sends the second to be judged: that happened hundreds of times.
    assert st.accepted_per_pos[0] > n // 10, st.accepted_per_pos
    # Bound: 16 categories, 3000 draws: expected total variation about 0.02; a sampler that kept
    # every draft, never corrected a rejection, or judged a later draft token by the wrong
    # probabilities is off by more than 0.1 here.
    for pos in range(4):
        assert _tv(counts[pos] / n, want[pos]) < 0.05, (pos, _tv(counts[pos] / n, want[pos]), st.accepted_per_pos)


def test_stats_as_vllm_counts_them() -> None:
    st = SpecStats()
    st.record(4, 2)
    st.record(4, 0)
    st.record(2, 2)
    assert (st.drafts, st.draft_tokens, st.accepted_tokens) == (3, 10, 4)
    assert st.accepted_per_pos == [2, 2, 0, 0]
    assert st.mean_acceptance_length == pytest.approx(1 + 4 / 3)
