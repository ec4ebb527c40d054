"""Suffix drafts: matches in the sequence's own text and in earlier outputs, frequency scores, the
store's bound and its keys, trees of candidates, the picker among proposers; and greedy output
through the engine identical with suffix (and all proposers) on and off."""

from __future__ import annotations

import pytest

from wafer.engine.sequence import SamplingParams, Sequence
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.ngram import NgramProposer
from wafer.engine.speculative.picker import PRIOR, PickingProposer
from wafer.engine.speculative.proposer import Draft
from wafer.engine.speculative.suffix import SuffixProposer
from wafer.engine.speculative.suffix_index import LiveIndex, OutputStore, SuffixParams, speculate

P = SuffixParams(max_depth=24, min_prob=0.1)


def test_a_match_in_the_own_text_proposes_what_followed_it() -> None:
    text = [1, 2, 3, 4, 5, 6, 7, 9, 9, 1, 2, 3]
    c = speculate(text, _live(text), None, 8, P)
    # (1, 2, 3) matched 3 tokens: at most 3 drafted (spec_factor 1), all seen once, all certain.
    assert c.tokens == [4, 5, 6] and c.match_len == 3 and c.probs == [1.0, 1.0, 1.0] and c.score == 3.0
    assert speculate(text, _live(text), None, 2, P).tokens == [4, 5]  # the step's limit bounds it
    assert speculate([8, 8, 1, 2], _live([8, 8, 1, 2]), None, 4, P).tokens == []  # nothing seen before


def _live(tokens: list[int]) -> LiveIndex:
    live = LiveIndex(tokens)
    live.update()
    return live


def test_the_most_frequent_continuation_wins_and_its_probability_is_its_share() -> None:
    # After (5, 6): 7 three times, 8 once, each after another token (every match is 2 long).
    text = [1, 5, 6, 7, 0, 2, 5, 6, 7, 0, 3, 5, 6, 8, 0, 4, 5, 6, 7, 0, 9, 5, 6]
    c = speculate(text, _live(text), None, 2, P)
    assert c.tokens == [7, 0] and c.probs == [0.75, 0.75] and c.score == 1.5
    # A floor above the share ends the draft before it starts.
    assert speculate(text, _live(text), None, 2, SuffixParams(min_prob=0.8)).tokens == []


def test_a_longer_match_outranks_a_frequent_short_one_when_it_scores_more() -> None:
    # (3, 4) is followed by 1 twice and by 9 once; the longer (2, 3, 4) only by 9, 9, 9.
    text = [0, 3, 4, 1, 0, 3, 4, 1, 2, 3, 4, 9, 9, 9, 0, 2, 3, 4]
    c = speculate(text, _live(text), None, 3, P)
    assert c.tokens == [9, 9, 9] and c.match_len >= 3


def test_a_match_running_into_the_suffix_repeats_its_period() -> None:
    text = [1, 2, 7, 8, 9, 7, 8, 9, 7, 8]
    assert speculate(text, _live(text), None, 6, SuffixParams(spec_offset=4)).tokens == [9, 7, 8, 9, 7, 8]


def test_earlier_outputs_are_drafted_from_and_kept_apart_by_key() -> None:
    store = OutputStore(max_tokens=1000, per_pair=64)
    store.add("a", [10, 11, 12, 13, 14, 15])
    ctx = [99, 10, 11, 12]
    assert speculate(ctx, _live(ctx), store.index("a"), 8, P).tokens == [13, 14, 15]
    assert speculate(ctx, _live(ctx), store.index("b"), 8, P).tokens == []  # another tenant sees nothing
    assert speculate(ctx, _live(ctx), store.index(None), 8, P).tokens == []


def test_the_store_keeps_its_bound_evicting_the_oldest_output_whatever_its_key() -> None:
    store = OutputStore(max_tokens=10, per_pair=64)
    store.add(None, [1, 2, 3, 4])
    store.add("t", [5, 6, 7, 8])
    store.add(None, [9, 1, 2, 10])  # 12 tokens: the first output goes
    assert store.tokens == 8 and store.tokens <= store.max_tokens
    ctx = [0, 1, 2]
    assert speculate(ctx, _live(ctx), store.index(None), 4, P).tokens == [10]  # (1, 2) now followed by 10 alone
    assert (1, 2) in store.index(None).where and len(store.index(None).where[(1, 2)]) == 1
    for _ in range(20):
        store.add("t", [5, 6, 7, 8, 9])
        assert store.tokens <= 10
    assert store.index(None) is None  # every output of None's was older
    t = store.index("t")
    assert len(t.texts) == 2 and sum(len(d) for d in t.where.values()) == 8  # two outputs' pairs remain


def test_a_tree_drafts_each_branch_under_its_parent_most_probable_first() -> None:
    # After (5, 6): 7, 1, 0 twice and 8, 2 once, each after another token (every match is 2 long).
    text = [11, 5, 6, 7, 1, 0, 12, 5, 6, 8, 2, 13, 5, 6, 7, 1, 0, 14, 5, 6]
    wide = SuffixParams(spec_offset=3)  # a 2-token match may draft 5
    c = speculate(text, _live(text), None, 5, wide, tree=True)
    assert list(zip(c.tokens, c.parents))[:4] == [(7, -1), (1, 0), (0, 1), (8, -1)]
    # Then one of three nodes as likely as 8: 2 after it, or 12 or 14 after 0.
    assert (c.tokens[4], c.parents[4]) in {(2, 3), (12, 2), (14, 2)}
    assert c.probs == pytest.approx([2 / 3, 2 / 3, 2 / 3, 1 / 3, 1 / 3]) and c.score == pytest.approx(8 / 3)
    path = speculate(text, _live(text), None, 5, wide)
    # A path: the best branch alone; of equal counts the latest seen (14, not 12).
    assert path.parents is None and path.tokens == [7, 1, 0, 14, 5]


def test_the_proposer_learns_finished_outputs_and_forgets_live_text() -> None:
    prop = SuffixProposer(SpeculativeConfig(method="suffix"))
    first = Sequence([1, 2], SamplingParams())
    first.tokens += [30, 31, 32, 33, 34]
    first.finish_reason = "stop"
    prop.finished(first)
    second = Sequence([7, 30, 31], SamplingParams())
    assert prop.propose([second], [5])[0].tokens == [32, 33]  # a 2-token match drafts 2
    prop.release(second.seq_id)
    assert second.seq_id not in prop._live
    other = Sequence([7, 30, 31], SamplingParams(cache_key="tenant"))
    assert prop.propose([other], [5])[0].tokens == []


def test_the_picker_takes_the_draft_expected_to_keep_most_and_learns_from_verification() -> None:
    cfg = SpeculativeConfig.parse("auto", 8)
    assert cfg.method == "auto" and cfg.methods == ("ngram", "suffix")
    picker = PickingProposer(NgramProposer(cfg), SuffixProposer(cfg), None)
    seq = Sequence([4, 5, 6, 7, 8, 9, 1, 4, 5, 6, 7], SamplingParams())
    # n-gram: a 4-token match drafts K, repeating its period (8 x 0.6 expected); suffix: 4 (a 4-token
    # match), each certain (4 x 1.0 expected).
    d = picker.propose([seq], [8])[0]
    assert d.tokens == [8, 9, 1, 4, 5, 6, 7, 8] and picker.method_of[seq.seq_id] == "ngram"
    picker.verified(seq, len(seq.tokens), 0, 8)  # none kept: n-gram's rate for the sequence falls
    d = picker.propose([seq], [8])[0]
    assert d.tokens == [8, 9, 1, 4] and picker.method_of[seq.seq_id] == "suffix"
    drafted = []
    for _ in range(40):  # nothing is ever kept: drafts stop, but for a try now and then
        picker.verified(seq, len(seq.tokens), 0, len(d.tokens))
        d = picker.propose([seq], [8])[0]
        drafted.append(bool(d.tokens))
    # Misses in a row: each method rests 2, 3, 5, 9, 17 ... steps, so of the last 20 steps two drafted.
    assert sum(drafted[:10]) >= 4 and sum(drafted[20:]) <= 2
    assert all(r < PRIOR[m] for m, r in picker._seqs[seq.seq_id].rates.items() if m != "draft")
    assert SpeculativeConfig.parse("suffix, ngram ,draft:luna").methods == ("suffix", "ngram", "draft")
    for bad in ("suffix,eagle", "draft:a,draft:b", "auto,"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


def test_suffix_and_auto_greedy_equal_plain(smollm) -> None:
    from tests.engine.speculative.test_speculative import chat, engine

    prompts = [chat(smollm, "List the days of the week, then list them again in reverse.")]
    sp = SamplingParams(max_tokens=32, temperature=0)
    plain = engine(smollm).generate(prompts, sp)
    for spec in ("suffix", "auto"):
        on = engine(smollm, spec, k=8)
        first = on.generate(prompts, sp)
        kept_first = on.stats.spec.accepted_tokens
        again = on.generate(prompts, sp)  # the first output is now in the store: drafted from across requests
        for a, b, c in zip(plain, first, again):
            assert b.output_ids == a.output_ids and c.output_ids == a.output_ids and b.text == a.text
        st = on.stats.spec
        assert st.accepted_tokens > 0 and sum(m.drafts for m in st.by_method.values()) == st.drafts
        assert st.decode_steps >= st.drafts > 0
        assert on.speculator.proposer is not None
        if spec == "suffix":  # the second request drafts from the first's output: it keeps more
            assert st.accepted_tokens - kept_first > kept_first


def test_the_picker_asks_the_draft_model_only_while_its_tokens_save_more_than_they_cost(monkeypatch) -> None:
    """A step of the target takes 40 ms and a drafted token 15 ms (a clock the test moves): a draft
    model whose tokens are kept half the time saves 20 ms a token and is asked; once its rate falls
    under 15/40 it is not, and a new sequence starts from that rate, not the prior."""
    from wafer.engine.speculative import picker as picking

    clock = [0.0]
    monkeypatch.setattr(picking.time, "perf_counter", lambda: clock[0])

    class Model:
        catch_up_seconds = 0.0

        def propose(self, seqs, limits):
            clock[0] += 0.015 * max(limits)  # a forward pass a token, every sequence at once
            return [Draft([1] * k) for k in limits]

        def verified(self, *a):
            pass

        def release(self, seq_id):
            pass

    picker = PickingProposer(None, None, Model())
    seq = Sequence([4, 5, 6, 7], SamplingParams())

    def step(kept: int) -> bool:
        d = picker.propose([seq], [4])[0]
        if d.tokens:
            picker.verified(seq, len(seq.tokens), kept, len(d.tokens))
        clock[0] += 0.040  # the target's step
        return bool(d.tokens)

    assert step(2)  # nothing measured: asked, and its cost measured
    assert picker.draft_token_seconds == pytest.approx(0.015)
    asked = [step(2) for _ in range(5)]  # half kept: 0.5 x 40 ms > 15 ms
    assert all(asked) and picker.step_seconds == pytest.approx(0.040), asked
    asked = [step(0 if i < 6 else 4) for i in range(30)]  # none kept: its rate falls, then it is not asked
    assert not any(asked[-10:]), asked
    assert picker.draft_rate < 0.015 / 0.040
    other = Sequence([9, 9, 9], SamplingParams())
    assert picker.propose([other], [4])[0].tokens == []  # a new sequence starts from the low rate
