"""Several proposers on at once, and for each sequence and step the one whose draft is expected to
keep the most tokens, or none."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from wafer.engine.sequence import Sequence
from wafer.engine.speculative.draft_model import DraftModelProposer
from wafer.engine.speculative.ngram import NgramProposer
from wafer.engine.speculative.proposer import Draft
from wafer.engine.speculative.suffix import SuffixProposer, to_draft

# A method's share of its drafted tokens kept, before a sequence has tried it: n-gram drafts after a
# short match are often cut short; a draft model of the same family keeps about half.
PRIOR = {"ngram": 0.6, "suffix": 1.0, "draft": 0.5}
ALPHA = 0.3  # weight of a step's outcome in a sequence's running rate
# After a draft that kept nothing its method rests this many steps for the sequence, twice as many
# after each further one in a row (up to MAX_REST): text that has turned from what it copied seldom
# turns back at once, and a rested method is tried again in time.
REST, MAX_REST = 1, 64
MIN_EXPECTED = 0.5  # tokens a draft must be expected to keep to be worth its rows
# Below this many expected tokens from the cheap proposers the draft model is asked: its draft costs
# a forward pass of its own, worth it where the text is new.
DRAFT_BELOW = 1.0
# Weight of a new measurement in the running costs of a step and of a draft model's token.
COST_ALPHA = 0.2
# A gap between two steps longer than this many running step times is idle time, not a step.
IDLE_GAP = 10.0


@dataclass
class _Seq:
    rates: dict[str, float] = field(default_factory=lambda: dict(PRIOR))
    last: tuple[str, float] | None = None  # the method of this step's draft and what it expected
    rest: dict[str, int] = field(default_factory=dict)  # method -> steps it sits out
    misses: dict[str, int] = field(default_factory=dict)  # method -> drafts in a row that kept nothing


class PickingProposer:
    """n-gram, suffix and a draft model together. For each sequence and step: the cheap proposers'
    drafts (n-gram and suffix lookups), each valued as the tokens it is expected to keep, its
    length (n-gram) or its frequency score (suffix) times the sequence's running rate for the method
    (kept over proposed, or kept over score); the draft model only where neither expects a token,
    its own rate for the sequence holds, and a drafted token, kept at that rate, saves more of the
    target's time than it costs (both measured); none where nothing is expected to keep half a token. A
    method whose draft kept nothing sits out a few steps for the sequence, more after each miss in a row.
    Whether drafting pays at all at the step's batch and length stays DraftLength's to measure."""

    def __init__(self, ngram: NgramProposer | None, suffix: SuffixProposer | None,
                 draft: DraftModelProposer | None) -> None:
        self.ngram, self.suffix, self.draft = ngram, suffix, draft
        self._seqs: dict[int, _Seq] = {}
        self.method_of: dict[int, str] = {}  # seq_id -> the method of its draft this step
        # The draft model's cost against its yield: seconds a step of the target takes (from the end
        # of one proposal to the next) and seconds a drafted token takes.
        self.step_seconds: float | None = None
        self.draft_token_seconds: float | None = None
        # The draft model's share of drafted tokens kept, over all sequences: a new sequence's start.
        self.draft_rate = PRIOR["draft"]
        self._last_propose: float | None = None  # when the last proposal ended

    def _draft_pays(self, rate: float) -> bool:
        """Whether a token from the draft model, kept at `rate`, is expected to save more of the
        target's time than it costs to draft: on a CPU a draft model of a third of the target's size
        costs a third of a step a token, and keeping under a third of them loses."""
        if self.step_seconds is None or self.draft_token_seconds is None:
            return True  # not measured yet: its first drafts measure it
        return rate * self.step_seconds >= self.draft_token_seconds

    def _observe_step(self) -> None:
        """The target's step: the time from the last proposal's end to this one."""
        now = time.perf_counter()
        if self._last_propose is not None:
            gap = now - self._last_propose
            if self.step_seconds is None:
                self.step_seconds = gap
            elif gap < IDLE_GAP * self.step_seconds:
                self.step_seconds += COST_ALPHA * (gap - self.step_seconds)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        self._observe_step()
        out: list[Draft] = [Draft([]) for _ in seqs]
        by_model: list[int] = []
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            st = self._seqs.get(seq.seq_id)
            if st is None:
                st = self._seqs[seq.seq_id] = _Seq()
                st.rates["draft"] = self.draft_rate
            st.last = None
            for m in list(st.rest):
                st.rest[m] -= 1
                if st.rest[m] <= 0:
                    del st.rest[m]
            best: tuple[float, str, Draft] | None = None
            if self.suffix is not None and "suffix" not in st.rest:
                c = self.suffix.candidate(seq, k)
                if c.tokens:
                    best = (c.score * st.rates["suffix"], "suffix", to_draft(c))
            if self.ngram is not None and "ngram" not in st.rest:
                d = self.ngram.propose([seq], [k])[0]
                v = len(d.tokens) * st.rates["ngram"]
                if d.tokens and (best is None or v > best[0]):
                    best = (v, "ngram", d)
            if (self.draft is not None and "draft" not in st.rest and (best is None or best[0] < DRAFT_BELOW)
                    and k * st.rates["draft"] >= MIN_EXPECTED and self._draft_pays(st.rates["draft"])):
                by_model.append(i)
                continue
            if best is not None and best[0] >= MIN_EXPECTED:
                out[i] = best[2]
                st.last = (best[1], best[0] / st.rates[best[1]] if st.rates[best[1]] > 0 else 0.0)
                self.method_of[seq.seq_id] = best[1]
        if by_model and self.draft is not None:
            started = time.perf_counter()
            drafts = self.draft.propose([seqs[i] for i in by_model], [limits[i] for i in by_model])
            # The draft model drafts a token of every sequence at once: a token costs a forward pass.
            longest = max((len(d.tokens) for d in drafts), default=0)
            if longest:
                per_token = (time.perf_counter() - started - self.draft.catch_up_seconds) / longest
                self.draft_token_seconds = per_token if self.draft_token_seconds is None else \
                    self.draft_token_seconds + COST_ALPHA * (per_token - self.draft_token_seconds)
            for i, d in zip(by_model, drafts):
                out[i] = d
                self._seqs[seqs[i].seq_id].last = ("draft", float(len(d.tokens)))
                self.method_of[seqs[i].seq_id] = "draft"
        self._last_propose = time.perf_counter()
        return out

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        st = self._seqs.get(seq.seq_id)
        if st is None or st.last is None:
            return
        method, base = st.last
        if base > 0:
            st.rates[method] += ALPHA * (min(accepted / base, 1.0) - st.rates[method])
            if method == "draft":
                self.draft_rate += ALPHA * (min(accepted / base, 1.0) - self.draft_rate)
        if accepted:
            st.misses.pop(method, None)
        else:
            st.misses[method] = st.misses.get(method, 0) + 1
            st.rest[method] = min(REST << (st.misses[method] - 1), MAX_REST) + 1
        if method == "draft" and self.draft is not None:
            self.draft.verified(seq, start_len, accepted, proposed)

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.method_of.pop(seq_id, None)
        for p in (self.ngram, self.suffix, self.draft):
            if p is not None:
                p.release(seq_id)

    def finished(self, seq: Sequence) -> None:
        if self.suffix is not None:
            self.suffix.finished(seq)
