"""Sampler features on hand-made logits, where the right answer is known."""

from __future__ import annotations

import math

import torch

from wafer.engine.sampler import CANDIDATES, Sampler, apply_penalties, filter_logits, kept_distribution, nucleus, tempered
from wafer.engine.sequence import SamplingParams, Sequence


def seq(params: SamplingParams, prompt=(0,), out=()) -> Sequence:
    s = Sequence(list(prompt), params)
    s.tokens.extend(out)
    return s


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    toks, _ = Sampler(0)(logits, [seq(SamplingParams(temperature=0)), seq(SamplingParams(temperature=0))])
    assert toks == [1, 0]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, 2, 1.0, 0.0)).tolist() == [False, False, True, True]
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it.
    assert torch.isinf(filter_logits(logits, 0, 0.7, 0.0)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.85, 0.0)).tolist() == [False, False, False, True]
    # min_p 0.2: keep tokens with p >= 0.2 * 0.5 = 0.1
    assert torch.isinf(filter_logits(logits, 0, 1.0, 0.2)).tolist() == [False, False, False, True]


def test_penalties_and_bias():
    logits = torch.tensor([2.0, 2.0, -2.0, 1.0])
    s = seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3], out=[0, 0, 1])
    out = apply_penalties(logits.clone(), s)
    assert out.tolist() == [2.0 - 0.5 - 0.5, 2.0 - 0.25 - 0.5, -2.0, 1.0]  # prompt token 3 untouched
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=[3], out=[0, 2])
    assert apply_penalties(logits.clone(), s).tolist() == [1.0, 2.0, -4.0, 0.5]
    s = seq(SamplingParams(logit_bias={2: 10.0, 0: -100.0}))
    assert apply_penalties(logits.clone(), s).tolist() == [-98.0, 2.0, 8.0, 1.0]
    toks, _ = Sampler(0)(logits.view(1, -1), [seq(SamplingParams(temperature=0, logit_bias={2: 10.0}))])
    assert toks == [2]


def test_the_repetition_penalty_follows_a_growing_sequence_looking_only_at_new_tokens():
    """The distinct tokens are kept up to date as the sequence grows (repeats, new ids, several at once
    as verified drafts add them), and each step penalises exactly the set of every token so far."""
    rng = torch.Generator().manual_seed(0)
    s = seq(SamplingParams(repetition_penalty=1.3), prompt=[5, 9, 5, 200], out=[])
    logits = torch.randn(256, generator=rng)
    for added in ([], [9], [7, 7, 5], [300 % 256], list(range(40, 140)), [3, 3, 3], []):
        s.tokens.extend(added)
        ids = torch.tensor(sorted(set(s.tokens)))
        want = logits.clone()
        want[ids] = torch.where(want[ids] > 0, want[ids] / 1.3, want[ids] * 1.3)
        assert torch.equal(apply_penalties(logits.clone(), s), want)
        assert s.seen is not None and s.seen._upto == len(s.tokens)
    assert sorted(s.seen.of(s.tokens).tolist()) == sorted(set(s.tokens))


def test_the_kernels_candidates_draw_what_torchs_would(monkeypatch):
    """A batch of rows at several settings (one that nothing filters, one greedy among them, one with
    +inf) draws the same tokens from the same seeds whether the candidates come from the kernels'
    top_candidates or from torch's softmax and topk."""
    from wafer.engine import sampler as sampler_module
    from wafer.kernels.build import kernels

    if kernels() is None:
        import pytest
        pytest.skip("wafer's kernels are off here (WAFER_KERNELS=off): only torch's way runs")
    g = torch.Generator().manual_seed(4)
    settings = [dict(temperature=0.7, top_p=0.8, top_k=20), dict(temperature=1.0), dict(temperature=0.2, top_p=0.9),
                dict(temperature=1.3, min_p=0.05), dict(temperature=0), dict(temperature=0.9, top_k=1000)]
    logits = torch.randn(len(settings), 3000, generator=g) * 3
    logits[2, 17] = float("inf")

    def draws() -> list[list[int]]:
        seqs = [seq(SamplingParams(seed=i, **kw)) for i, kw in enumerate(settings)]
        sampler = Sampler(0)
        return [sampler(logits.clone(), seqs)[0] for _ in range(40)]

    real, calls = kernels(), []

    class Spy:  # the kernels, counting the calls that matter here
        def __getattr__(self, name):
            return getattr(real, name)

        def top_candidates(self, *args):
            calls.append(args[0].shape[0])
            return real.top_candidates(*args)

    monkeypatch.setattr(sampler_module, "kernels", Spy)
    with_kernels = draws()
    assert calls and all(rows == len(settings) - 1 for rows in calls)  # the sampled rows, not the greedy one
    monkeypatch.setattr(sampler_module, "kernels", lambda: None)
    assert draws() == with_kernels
    assert all(row[2] == 17 for row in with_kernels)


def test_the_kept_distribution_is_filter_logits_softmax_from_the_candidates():
    """What speculative verification draws from: the same tokens kept, the same probabilities, at the
    settings where the candidates hold the kept set; the whole row's way (None) where they may not."""
    from wafer.kernels.build import kernels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(50000, generator=g) * 3
    for kw in (dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0), dict(temperature=0.2, top_k=0, top_p=0.9, min_p=0.0),
               dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1), dict(temperature=1.5, top_k=5, top_p=1.0, min_p=0.0)):
        got = kept_distribution(x, **kw)
        if kernels() is None:
            assert got is None
            continue
        want = filter_logits(tempered(x, kw["temperature"]), kw["top_k"], kw["top_p"], kw["min_p"]).softmax(-1)
        assert got is not None and torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6), kw
    assert kept_distribution(x, 1.0, 0, 1.0, 0.0) is None  # nothing filters the row: its whole softmax
    assert kept_distribution(x, 1.0, 1000, 1.0, 0.0) is None  # top-k past the candidates
    assert kept_distribution(torch.full((300,), float("-inf")), 1.0, 5, 1.0, 0.0) is None  # nothing left


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().view(1, -1)
    s = seq(SamplingParams(temperature=1.0, seed=1))
    sampler = Sampler(0)
    n = 4000
    counts = torch.zeros(3)
    for _ in range(n):
        counts[sampler(logits, [s])[0][0]] += 1
    # Each frequency within 4 standard deviations of its expectation.
    for p, c in zip(probs.tolist(), counts.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = seq(SamplingParams(temperature=0.05, seed=3))
    toks = [Sampler(0)(logits, [hot])[0][0] for _ in range(200)]
    assert toks.count(0) == 200


def test_logprobs_top_alternatives():
    logits = torch.log(torch.tensor([[0.1, 0.7, 0.2]]))
    toks, lps = Sampler(0)(logits, [seq(SamplingParams(temperature=0, logprobs=2))])
    assert toks == [1]
    assert abs(lps[0].logprob - math.log(0.7)) < 1e-6
    assert [t for t, _ in lps[0].top] == [1, 2]


def test_logprobs_of_masked_tokens_are_finite():
    """Tokens a grammar masks out have logprob -inf, which JSON cannot carry: each reported logprob,
    the chosen token's and its alternatives', is at least -9999.0 (as vLLM and OpenAI report them)."""
    from wafer.engine.sampler import LOGPROB_FLOOR

    logits = torch.tensor([[0.0, float("-inf"), float("-inf"), 1.0]])
    _, lps = Sampler(0)(logits, [seq(SamplingParams(temperature=0, logprobs=3))])
    values = [lps[0].logprob, *(v for _, v in lps[0].top)]
    assert all(math.isfinite(v) for v in values), values
    assert lps[0].top[-1][1] == LOGPROB_FLOOR == -9999.0


def test_best_is_torch_max_index():
    """The greedy pick, wafer's kernel where it is built, against torch.max: first of tied maxima, a
    NaN's index, all -inf rows, lengths around the 16-lane width, 1-D rows and row views."""
    from wafer.engine.sampler import best

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(3, n, generator=g) for n in (1, 15, 16, 17, 49152)]
    ties = torch.randint(0, 4, (6, 100), generator=g).float()  # many maxima in each row
    special = torch.randn(4, 40, generator=g)
    special[0] = float("-inf")
    special[1, 7] = float("nan")
    special[1, 30] = float("inf")
    special[2, 33] = float("nan")
    special[2, 2] = float("nan")
    special[3, :] = 1.0
    cases += [ties, special, special[:, 5:], torch.randn(2, 64, generator=g)[:, ::2]]
    for x in cases:
        assert best(x).tolist() == x.max(dim=-1).indices.tolist(), x.shape
        assert best(x[0]).item() == x[0].max(dim=-1).indices.item()
        assert best(x[0]).dim() == 0


def test_extreme_penalty_or_temperature_still_samples():
    """repetition_penalty 1e-300 sends a seen token's logit to infinity, and a temperature of 1e-9
    overflows ordinary ones: neither may give NaN probabilities (which failed the whole step, every
    sequence in it with the bad one). The infinite logit wins, as it does greedily."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 5
    logits[0, 7] = 4.0  # token 7 is in the first sequence's prompt, with a positive logit
    seqs = [Sequence([7, 9], SamplingParams(temperature=0.7, repetition_penalty=1e-300)),
            Sequence([1], SamplingParams(temperature=1e-9)),
            Sequence([1], SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1e-300))]
    chosen, _ = Sampler(seed=0)(logits.clone(), seqs)
    assert chosen[0] == 7
    assert chosen[1] == int(logits[1].argmax())
    assert 0 <= chosen[2] < 50


def test_nucleus_keeps_what_filtering_the_whole_row_keeps():
    """Over rows shaped like a model's (a few likely tokens, a long tail) and flat ones, at several
    temperatures: wherever nucleus() answers, its tokens are exactly those filter_logits leaves, and
    their renormalised probabilities are filter_logits' distribution."""
    gen = torch.Generator().manual_seed(5)
    answered = 0
    for trial in range(300):
        vocab = 2000
        logits = torch.randn(vocab, generator=gen) * (4.0 if trial % 3 else 0.3)
        temperature = [0.2, 0.7, 1.0, 1.5][trial % 4]
        top_k = [0, 0, 5, 40, 300][trial % 5]
        top_p = [1.0, 0.9, 0.5, 0.99][trial % 4 if trial % 7 else 0]
        min_p = [0.0, 0.0, 0.05, 0.001][trial % 4 if trial % 2 else 0]
        scaled = logits / temperature
        want = filter_logits(scaled, top_k, top_p, min_p).softmax(-1)
        probs = scaled.softmax(-1)
        top, idx = probs.topk(CANDIDATES)
        n = nucleus(top.tolist(), top.cumsum(-1).tolist(), top_k, top_p, min_p)
        if n is None:
            continue
        answered += 1
        assert set(idx[:n].tolist()) == set(torch.nonzero(want).flatten().tolist()), (trial, n)
        assert torch.allclose(top[:n] / top[:n].sum(), want[idx[:n]], atol=1e-6)
    assert answered > 150  # the usual settings are answered among the candidates


def test_batched_draws_follow_the_filtered_distribution():
    """Rows of one batch with their own top-p, top-k and temperature: each token's frequency is
    what filter_logits' distribution gives it, within four standard deviations."""
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=1), SamplingParams(temperature=0.8, top_k=3, seed=2),
              SamplingParams(temperature=1.3, seed=3), SamplingParams(temperature=0)]
    seqs = [seq(p) for p in params]
    n = 3000
    counts = torch.zeros(len(params), 6)
    sampler = Sampler(0)
    for _ in range(n):
        toks, _ = sampler(logits.repeat(len(params), 1), seqs)
        for r, t in enumerate(toks):
            counts[r, t] += 1
    for r, p in enumerate(params[:3]):
        want = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        for q, c in zip(want.tolist(), counts[r].tolist()):
            assert abs(c / n - q) <= 4 * math.sqrt(q * (1 - q) / n) + 1e-9, (r, counts[r], want)
    assert counts[3, 0] == n  # the greedy row of the batch


def test_a_row_that_allows_no_token_fails_rather_than_picks_one():
    logits = torch.full((2, 5), float("-inf"))
    logits[1, 3] = 0.0
    seqs = [seq(SamplingParams(temperature=0.7, top_p=0.9, seed=1)), seq(SamplingParams(temperature=0.7, seed=2))]
    try:
        Sampler(0)(logits, seqs)
    except (ValueError, RuntimeError):
        pass
    else:
        raise AssertionError("a row of -inf logits gave a token")
    assert Sampler(0)(logits[1:], seqs[1:])[0] == [3]


def test_no_repetition_penalty_inside_the_json_a_grammar_holds():
    """A call's arguments copy the prompt (a city, a code the user gave): inside the JSON of a tool
    call or a `response_format` reply the repetition penalty is not applied; outside it, it is."""
    from types import SimpleNamespace

    logits = torch.tensor([2.0, 2.0, -2.0, 1.0])
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=[3], out=[0, 2])
    s.matcher = SimpleNamespace(in_json=lambda: True)
    assert apply_penalties(logits.clone(), s).tolist() == logits.tolist()
    s.matcher = SimpleNamespace(in_json=lambda: False)
    assert apply_penalties(logits.clone(), s).tolist() == [1.0, 2.0, -4.0, 0.5]
