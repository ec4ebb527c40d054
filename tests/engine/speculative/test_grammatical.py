"""Speculation under a grammar (tool calls, `response_format`): drafts cut to what the grammar accepts,
each verified position masked as plain constrained decoding masks it, so greedy output is token for
token the plain one and sampled output keeps its distribution."""

from __future__ import annotations

import json

import pytest
import torch
from llguidance import LLMatcher

from tests.engine.speculative.test_speculative import _tv, chat, engine
from wafer.engine.constraints import Constraints
from wafer.engine.sampler import LOGPROB_FLOOR, Sampler
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import SamplingParams, Sequence, SequenceOutput
from wafer.engine.speculative.grammatical import grammatical
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.proposer import Draft
from wafer.engine.speculative.verification import verify

# A tool call's shape, as an agent writes it turn after turn; its keys in another order than the
# prompt's calls and its tool another than theirs, so that the grammar, not the model, picks some tokens.
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "tool": {"const": "write_file"},
                                           "line": {"type": "integer"}},
          "required": ["path", "tool", "line"], "additionalProperties": False}


def _grammar() -> str:
    return LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def calls_prompt(smollm) -> list[int]:
    """A prompt that shows the JSON the answer repeats: the drafts have something to copy."""
    calls = [{"tool": "read_file", "path": f"src/wafer/engine/module_{i}.py", "line": 10 * i} for i in range(6)]
    return chat(smollm, "Earlier calls:\n" + "\n".join(json.dumps(c) for c in calls)
                + "\nThe next call, the same tool on the next module:")


@pytest.fixture(scope="module")
def plain_calls(smollm, calls_prompt) -> list[Sequence]:
    sp = SamplingParams(max_tokens=60, temperature=0, grammar=_grammar(), logprobs=2)
    out = engine(smollm).generate([calls_prompt, calls_prompt], sp)
    assert all(s.finish_reason == "stop" for s in out)
    json.loads(out[0].text)
    return out


def test_a_chain_is_cut_to_its_longest_accepted_prefix_and_a_tree_to_its_accepted_paths(smollm) -> None:
    constraints = Constraints(smollm.tokenizer)
    m = constraints.matcher(LLMatcher.grammar_from_lark('start: "a" "b" ("1" | "2") "c"'))
    a, b, one, two, c, bad = (constraints.llt.tokenize_str(ch)[0] for ch in "ab12cx")
    chain = [a, b, bad, c]
    assert grammatical(Draft(chain, torch.eye(4)), m).tokens == [a, b]
    assert grammatical(Draft(chain, torch.eye(4)), m).probs.shape == (2, 4)
    assert grammatical(Draft([bad, a]), m).tokens == []
    assert m.validate_tokens(chain) == 2 and not m.is_error()  # validation consumed nothing
    assert grammatical(Draft([a, b, one, c]), m) == Draft([a, b, one, c])
    # a -> b -> {x, 1 -> c, 2 -> x}: the paths through x end before it.
    tree = Draft([a, b, bad, one, two, c, bad], parents=[-1, 0, 1, 1, 1, 3, 4])
    cut = grammatical(tree, m)
    assert cut.tokens == [a, b, one, two, c] and cut.parents == [-1, 0, 1, 1, 2]
    # A tree whose only accepted path is a chain comes back as the chain.
    assert grammatical(Draft([a, bad, b], parents=[-1, 0, 0]), m) == Draft([a, b])


@pytest.mark.parametrize("method", ["ngram", "suffix", "suffix-tree", "draft:self"])
def test_greedy_under_a_grammar_with_drafts_equals_plain(smollm, calls_prompt, plain_calls, method) -> None:
    """Token for token the output of plain constrained decoding, batched; drafts were verified and
    kept (the answer copies the prompt's JSON). The model as its own draft proposes what it would
    write unconstrained: cut where the grammar picks otherwise, its KV kept only for what was kept."""
    sp = SamplingParams(max_tokens=60, temperature=0, grammar=_grammar())
    sc = SpeculativeConfig.parse(method.removesuffix("-tree"), 6, "fixed")
    sc.suffix_tree = method.endswith("-tree")
    spec = engine(smollm, sc, draft=smollm if method.startswith("draft") else None)
    trees = _count_trees(spec)
    out = spec.generate([calls_prompt, calls_prompt], sp)
    for a, b in zip(plain_calls, out):
        assert b.output_ids == a.output_ids and b.text == a.text and b.finish_reason == a.finish_reason
    st = spec.stats.spec
    assert st.accepted_tokens > 10 and st.mean_acceptance_length > 1.5 and st.grammar_cut_tokens > 0, st
    assert (trees[0] > 0) == sc.suffix_tree  # trees of several paths reached verification


def _count_trees(spec) -> list[int]:
    """A counter of the drafts verified as trees (not chains) in `spec`'s steps."""
    count = [0]
    verify = spec.speculator.verify

    def counting(item, *args):
        count[0] += item.tree is not None
        return verify(item, *args)

    spec.speculator.verify = counting
    return count


class _Oracle:
    """Proposes what plain decoding wrote next (every draft position is then verified and kept, so each
    emitted token past the first goes through a masked verification row), with every other draft's
    second token swapped for one the grammar refuses there."""

    def __init__(self, want: list[int], constraints: Constraints) -> None:
        self.want, self.constraints, self.calls = want, constraints, 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, limits):
            done = len(seq.tokens) - seq.num_prompt
            draft = self.want[done : done + k]
            self.calls += 1
            if self.calls % 2 == 0 and len(draft) > 1:
                m = seq.matcher.inner.deep_copy()
                m.consume_tokens(draft[:1])
                draft[1] = next(t for t in range(1000) if m.validate_tokens([t]) == 0)
            out.append(Draft(draft))
        return out

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


def test_a_draft_the_grammar_refuses_is_cut_and_every_position_is_masked(smollm, calls_prompt, plain_calls) -> None:
    """Refused tokens never reach verification (and nothing invalid is emitted); drafts of what plain
    decoding wrote are kept whole. Without each position's own mask (the mask of the state the path
    so far leaves), their rows' unmasked argmax would differ from the grammar's at some position."""
    spec = engine(smollm, "ngram", k=4)
    want = plain_calls[0].output_ids
    spec.speculator.proposer = _Oracle(want, spec.constraints)
    sp = SamplingParams(max_tokens=60, temperature=0, grammar=_grammar(), logprobs=2)
    out = spec.generate([calls_prompt], sp)[0]
    assert out.output_ids == want and json.loads(out.text) == json.loads(plain_calls[0].text)
    # Logprobs of the rows as masked, as plain decoding reports them (a refused alternative at the floor).
    plain_lp = plain_calls[0].logprobs
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in plain_lp], abs=1e-3)
    allowed = [[t for t, v in lp.top if v > LOGPROB_FLOOR] for lp in out.logprobs]
    assert allowed == [[t for t, v in lp.top if v > LOGPROB_FLOOR] for lp in plain_lp]
    assert any(len(a) == 1 for a in allowed)  # a position the grammar forced: its alternative refused
    st = spec.stats.spec
    assert st.grammar_cut_tokens > 0 and st.accepted_tokens >= len(want) // 2, st


def test_near_max_tokens_the_completion_search_still_closes_the_json(smollm, calls_prompt, plain_calls) -> None:
    """max_tokens a few tokens short of what the model would write: verification's masks narrow to
    the way to finish (the completion search, with the tokens left at each position), as plain
    decoding's do, and the reply is the same valid JSON."""
    sp = SamplingParams(max_tokens=len(plain_calls[0].output_ids) - 6, temperature=0, grammar=_grammar())
    plain = engine(smollm).generate([calls_prompt], sp)[0]
    spec = engine(smollm, "ngram", k=6)
    out = spec.generate([calls_prompt], sp)[0]
    assert out.output_ids == plain.output_ids and out.finish_reason == plain.finish_reason == "stop"
    assert json.loads(out.text).keys() == SCHEMA["properties"].keys()
    assert spec.stats.spec.accepted_tokens > 0


def test_a_request_past_its_grammar_budget_in_verification_ends_alone(smollm, calls_prompt, plain_calls) -> None:
    """The grammar budget counts the masks of verified rows: past it, the request ends with its error
    in the verifying step, and the sequence beside it goes on."""
    spec = engine(smollm, "ngram", k=4)
    oracle = spec.speculator.proposer = _Oracle(plain_calls[0].output_ids, spec.constraints)
    seq = spec.add(calls_prompt, SamplingParams(max_tokens=60, temperature=0, grammar=_grammar()))
    other = spec.add(calls_prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while len(seq.tokens) == seq.num_prompt:
        spec.step()
    spec.picker.grammar_seconds_per_token = 1e-9
    outs = [o for o in spec.step() if o.seq_id == seq.seq_id]
    assert oracle.calls == 1 and seq.finish_reason == "error"  # a step that verified a draft of 4
    assert outs[-1].error.startswith("GrammarTooCostly") and "grammar_ms_per_token" in outs[-1].error
    while not other.finished:
        spec.step()
    assert other.finish_reason == "length" and len(other.output_ids) == 12


def test_sampled_verification_under_a_mask_keeps_the_masked_distribution() -> None:
    """A sampled sequence whose grammar allows other tokens at each position (a mask that follows
    its length): each verified position is distributed as the masked row, drafts kept or not,
    including a draft token the next position's mask refuses."""
    torch.manual_seed(0)
    vocab = 8
    rows = torch.randn(3, vocab) * 1.5
    allowed = {0: [0, 1, 2, 3], 1: [2, 3, 4, 5], 2: [1, 5, 6, 7]}  # by tokens generated so far

    def masked(pos: int) -> torch.Tensor:
        keep = torch.full((vocab,), float("-inf"))
        keep[allowed[pos]] = 0.0
        return (rows[pos] + keep).softmax(-1)

    want0, want1 = masked(0), masked(1)
    sampler = Sampler(seed=1)
    n = 6000
    counts = torch.zeros(2, vocab)

    def append(seq: Sequence, token: int, lp) -> SequenceOutput:
        seq.tokens.append(token)
        return SequenceOutput(seq.seq_id, [token], "", False, None, [], seq.num_prompt, 0, 0)

    for i in range(n):
        seq = Sequence([9], SamplingParams(temperature=1.0, max_tokens=10))
        seq.tokens = [9]

        def mask(row: torch.Tensor, seq=seq) -> None:
            pos = len(seq.tokens) - 1
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[allowed[pos]] = True
            row.masked_fill_(~keep, float("-inf"))

        draft = [3, 1] if i % 2 else [0, 4]  # 1 is refused at position 1; 0 and 4 often differ from the draw
        item = ScheduledSeq(seq, 0, 3, draft=draft, rows=3)
        outs, _ = verify(item, rows.clone(), sampler, append, mask)
        tokens = [o.new_token_ids[0] for o in outs]
        counts[0, tokens[0]] += 1
        if tokens[0] == draft[0]:  # the second position was verified too
            counts[1, tokens[1]] += 1
        assert all(t in allowed[p] for p, t in enumerate(tokens))
    assert _tv(counts[0] / n, want0) < 0.03
    assert _tv(counts[1] / counts[1].sum(), want1) < 0.04
