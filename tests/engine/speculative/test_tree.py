"""Tree verification: several candidate continuations verified in one step. Greedy output equal to
plain decoding (token, logprob) with trees whose right path is often not the first, on the fused
CPU step and the Python model, a window included; sampled output distributed as the target's; and
the tree's shape (masks, positions, where an accepted path's KV rows go)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.speculative.test_speculative import PROMPT, _marginals, _tv, engine, tiny_pair  # noqa: F401
from wafer.engine.sequence import SamplingParams, Sequence
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.draft_tree import DraftTree, accepted_moves, remap_rows, tree_masks
from wafer.engine.speculative.proposer import Draft
from wafer.engine.speculative.verification import rejection_sample
from wafer.models.loader import load_model


def test_tree_shape() -> None:
    #        root
    #       /    \
    #      0      2
    #      |     / \
    #      1    3   4
    #               |
    #               5
    t = DraftTree.of(6, [-1, 0, -1, 2, 2, 4])
    assert t.depth == (1, 2, 1, 2, 2, 3)
    assert t.children(-1) == [0, 2] and t.children(2) == [3, 4] and t.children(5) == []
    assert t.path(5) == [2, 4, 5] and t.first_path() == [0, 1]
    assert t.positions(9) == [10, 11, 10, 11, 11, 12]
    sees = t.sees()
    assert sees[5].tolist() == [False, False, True, False, True, True]
    assert sees[1].tolist() == [True, True, False, False, False, False]
    # Node i is written at L + i; rotary positions from the first one off its place read elsewhere.
    assert remap_rows(10, t) == [[11], [12], [10, 12], [10, 12, 13], [10, 12, 14], [10, 12, 14, 15]]
    assert accepted_moves(10, [2, 4, 5]) == ([12, 14, 15], [10, 11, 12])
    assert accepted_moves(10, [0, 1]) == ([], [])  # the first path lies in place
    chain = DraftTree.of(3, None)
    assert chain.is_chain and chain.parents == (-1, 0, 1) and not t.is_chain
    assert remap_rows(10, chain) == [[11], [12], [13]]
    for bad in ([0, -1], [-1, 1], [-2]):
        with pytest.raises(ValueError):
            DraftTree.of(len(bad), bad)


def test_tree_masks() -> None:
    t = DraftTree.of(3, [-1, -1, 1])  # two children of the root; node 2 under node 1
    m = tree_masks(4, 1, t, {None, 2})
    # Keys: positions 0..4 (the root at 4), then nodes 0, 1, 2 at rotary positions 5, 5, 6.
    assert m[None].tolist() == [[True] * 5 + [False] * 3,
                                [True] * 5 + [True, False, False],
                                [True] * 5 + [False, True, False],
                                [True] * 5 + [False, True, True]]
    # A window of 2 counts rotary positions: node 2 (at 6) sees node 1 (5) and itself, not the root (4).
    assert m[2].tolist()[3] == [False] * 5 + [False, True, True]
    assert m[2].tolist()[1] == [False] * 4 + [True] + [True, False, False]


class OracleTrees:
    """Trees from the target's known greedy continuation: at each depth a wrong sibling (with a
    child of its own) and the right token, the wrong one first on odd steps, so that accepted paths
    run through later branches and their rows move; every third tree ends in a wrong token."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.refs, self.vocab, self.calls = refs, vocab, 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        out = []
        for seq, limit in zip(seqs, limits):
            self.calls += 1
            ref = self.refs[tuple(seq.tokens[: seq.num_prompt])]
            n = len(seq.tokens)
            right = ref[n : n + limit]
            if self.calls % 3 == 0 and right:
                right[-1] = (right[-1] + 5) % self.vocab
            tokens: list[int] = []
            parents: list[int] = []
            parent = -1
            for d, token in enumerate(right):
                wrong = (token + 1 + d) % self.vocab
                nxt = None
                for tok in ([wrong, token] if (self.calls + d) % 2 else [token, wrong]):
                    if len(tokens) >= limit:
                        break
                    tokens.append(tok)
                    parents.append(parent)
                    if tok == token:
                        nxt = len(tokens) - 1
                    elif len(tokens) < limit:  # a wrong branch goes on a little
                        tokens.append((tok + 3) % self.vocab)
                        parents.append(len(tokens) - 2)
                if nxt is None:
                    break
                parent = nxt
            out.append(Draft(tokens, None, parents))
        return out

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


def _greedy_equal_with_trees(loaded, prompts: list[list[int]], max_tokens: int, exact: bool) -> None:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    plain = [engine(loaded).generate([p], sp)[0] for p in prompts]
    refs = {tuple(p): p + s.output_ids for p, s in zip(prompts, plain)}
    spec = engine(loaded, "ngram", k=7)
    spec.speculator.proposer = OracleTrees(refs, loaded.config.vocab_size)
    moves = []
    move = spec.kv.move
    spec.kv.move = lambda slot, src, dst: (moves.append(len(src)), move(slot, src, dst))[1]  # type: ignore[method-assign]
    alone = [spec.generate([p], sp)[0] for p in prompts]
    batched = spec.generate(prompts, sp)
    for a, b, c in zip(plain, alone, batched):
        for got in (b, c):
            assert got.output_ids == a.output_ids
            lps, want = [lp.logprob for lp in got.logprobs], [lp.logprob for lp in a.logprobs]
            # The next steps read the moved rows: their logits are decoding's (bitwise on the fused step).
            assert lps == want if exact else lps == pytest.approx(want, abs=1e-4)
    st = spec.stats.spec
    assert moves and 0 < st.accepted_tokens < st.draft_tokens  # later branches kept, wrong ones not
    # The blocks of a finished answer, moved rows among them, are a cached prefix for a prompt that
    # goes on from it: it goes on as decoding does.
    for p, a in zip(prompts, plain):
        more = spec.generate([p + a.output_ids[:-4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert more.num_cached_prompt > len(p) and more.output_ids == a.output_ids[-4:]


def test_greedy_trees_equal_plain_on_the_fused_step() -> None:
    """The fused step reads each node's path in its positions' order: its logits, and the moved
    rows the next steps read, are bitwise those of decoding the path."""
    q4 = load_model(compute="q4")
    from tests.engine.speculative.test_speculative import chat

    prompts = [chat(q4, "List the days of the week."), chat(q4, "Write a haiku about the sea.")]
    _greedy_equal_with_trees(q4, prompts, 24, exact=True)


@pytest.fixture(scope="module")
def tiny_windowed(tmp_path_factory):
    """A Mistral-shaped model with a window of 6 (drafts straddle it) and a 16-token vocabulary."""
    from tests.tiny import make_hf_model

    path = make_hf_model(tmp_path_factory.mktemp("windowed"), "mistral", seed=3, vocab_size=16, hidden_size=64,
                         intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                         initializer_range=0.5)
    return path


@pytest.mark.parametrize("compute", ["f32", "q8"])
def test_greedy_trees_equal_plain_with_a_window(tiny_windowed, compute) -> None:
    """f32: the Python model, tree masks; q8: the fused step, remapped rows; both with a window."""
    loaded = load_model(str(tiny_windowed), compute=compute)
    assert loaded.config.windows[0] == 6
    prompts = [[1, 3, 4, 5, 6, 7, 8, 9], [1, 9, 9, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    _greedy_equal_with_trees(loaded, prompts, 30, exact=compute == "q8")


class FixedTrees:
    """The same tree shape at every step, its tokens a function of the last token: three candidates
    at the root, two under the first, one under the second (a deterministic proposal)."""

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        out = []
        for seq, limit in zip(seqs, limits):
            t = seq.tokens[-1]
            tokens = [(t + 1) % 16, (t + 3) % 16, (t * 5 + 2) % 16, 3, 4, 3]
            parents = [-1, -1, -1, 0, 0, 1]
            out.append(Draft(tokens[:limit], None, parents[:limit]))
        return out

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


def test_sampled_trees_follow_the_target_distribution(tiny_pair, monkeypatch) -> None:
    """At temperature 0.7, every token is distributed as the target samples it, whichever of a
    node's candidates is kept, or none: the distribution of each of the first three tokens against
    the target's, summed over the paths before it (the second and third come from trees, the third
    from a node of depth 2 where the first candidate was kept)."""
    from wafer.engine.speculative import verification

    target = tiny_pair[0]
    want = _marginals(target, PROMPT, 3, temperature=0.7)
    kept_at: list[int | None] = []
    sample = verification.rejection_sample
    monkeypatch.setattr(verification, "rejection_sample",
                        lambda *a: (r := sample(*a), kept_at.append(r[1]))[0])
    n = 2000
    spec = SpeculativeConfig.parse("ngram", 6)
    spec.max_running = 100
    eng = engine(target, spec, max_running=100, seed=0)
    eng.speculator.proposer = FixedTrees()
    counts = torch.zeros(3, 16)
    sp = SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True)
    for _ in range(n // 100):
        for s in eng.generate([PROMPT] * 100, sp):
            for pos in range(3):
                counts[pos, s.output_ids[pos]] += 1
    st = eng.stats.spec
    assert st.drafts > n // 2 and 0 < st.accepted_tokens < st.draft_tokens
    # Every way out of a node ran dozens of times at least: its first, a later candidate, or none.
    # A later candidate is kept in 1-3% of the walks (which tokens the runs reach decides it).
    ways = (kept_at.count(0), kept_at.count(1) + kept_at.count(2), kept_at.count(None))
    assert min(ways) > n // 100, ways
    # Bound: 16 categories, 2000 draws: expected total variation about 0.025; a walk that judged
    # a later candidate against p instead of the residual, or never corrected a rejection, is off
    # by more than 0.1.
    for pos in range(3):
        assert _tv(counts[pos] / n, want[pos]) < 0.06, (pos, _tv(counts[pos] / n, want[pos]))


def test_multi_candidate_rejection_keeps_the_target_distribution() -> None:
    """Candidates tried in turn against the residual: distributed as p, for deterministic
    candidates (one-hot q) and for candidates drawn independently from q."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.00, 0.15, 0.20, 0.10, 0.15, 0.05])
    q = torch.tensor([0.30, 0.05, 0.20, 0.05, 0.10, 0.10, 0.10, 0.10])
    n = 20_000  # expected total variation about 0.008
    counts = torch.zeros(8)
    kept = torch.zeros(4)
    for _ in range(n):
        token, i = rejection_sample(p, [4, 1, 6], None, gen)
        counts[token] += 1
        kept[3 if i is None else i] += 1
    assert _tv(counts / n, p) < 0.015
    # Each candidate is kept as often as p gives its token: p(4), then (1 - p(4)) p(1) / (1 - p(4)), ...
    assert (kept / n).tolist() == pytest.approx([0.2, 0.3, 0.15, 0.35], abs=0.015)
    counts.zero_()
    draws = torch.multinomial(q, 3 * n, replacement=True, generator=gen).view(n, 3).tolist()
    for d in draws:
        counts[rejection_sample(p, d, [q, q, q], gen)[0]] += 1
    assert _tv(counts / n, p) < 0.015


def test_trees_through_pipeline_stages_are_cut_to_their_first_path(tiny_pair) -> None:
    """Stages hold the KV in their processes, where an accepted path's rows cannot move: a tree
    is verified as its first path, a chain, whose rows lie in place."""
    e = engine(tiny_pair[0], "ngram", k=6)
    sp = e.speculator
    tree = Draft([5, 6, 7, 8], None, [-1, -1, 0, 2])
    assert sp._shaped(tree, 4) is tree
    sp.kv = None
    cut = sp._shaped(tree, 4)
    assert cut.tokens == [5, 7, 8] and cut.parents is None
    chain = sp._shaped(Draft([1, 2], None, [-1, 0]), 4)
    assert chain.parents is None
    with pytest.raises(ValueError):
        sp._shaped(Draft([1, 2, 3], None, None), 2)
