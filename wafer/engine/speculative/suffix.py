"""Suffix drafts: from the sequence's own text and from earlier requests' outputs, scored by how
often each continuation was seen (suffix_index.py)."""

from __future__ import annotations

from wafer.engine.sequence import Sequence
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.proposer import Draft
from wafer.engine.speculative.suffix_index import Candidate, LiveIndex, OutputStore, SuffixParams, speculate


class SuffixProposer:
    """Each sequence's draft is the best-scoring continuation of its last tokens in its own prompt
    and output and in the outputs of earlier requests of its key (`SamplingParams.cache_key`),
    as long as its estimated probability holds and at most the step's limit: a draft's length
    follows how often its continuation was seen. An output joins the store when its sequence
    finishes; the store keeps `suffix_cache_tokens` tokens in all, the oldest going first.

    `tree` (suffix_tree) drafts several branches (`Draft.parents`), verified in one step; a path otherwise."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.params = SuffixParams(max_depth=cfg.suffix_max_depth, min_prob=cfg.suffix_min_prob)
        self.store = OutputStore(cfg.suffix_cache_tokens, self.params.max_occurrences)
        self.tree = cfg.suffix_tree
        self._live: dict[int, tuple[Sequence, LiveIndex]] = {}
        self.scores: dict[int, float] = {}  # seq_id -> the score of its last draft (tokens expected kept)

    def candidate(self, seq: Sequence, k: int, tree: bool | None = None) -> Candidate:
        entry = self._live.get(seq.seq_id)
        if entry is None or entry[0] is not seq:
            entry = self._live[seq.seq_id] = (seq, LiveIndex(seq.tokens))
        live = entry[1]
        if live.tokens is not seq.tokens:  # the list was replaced: index it afresh
            live = LiveIndex(seq.tokens)
            self._live[seq.seq_id] = (seq, live)
        live.update()
        return speculate(seq.tokens, live, self.store.index(seq.params.cache_key), k, self.params,
                         self.tree if tree is None else tree)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, limits):
            c = self.candidate(seq, k)
            self.scores[seq.seq_id] = c.score
            out.append(to_draft(c))
        return out

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self._live.pop(seq_id, None)
        self.scores.pop(seq_id, None)

    def finished(self, seq: Sequence) -> None:
        """A finished sequence's output joins the store (whether or not it was drafted for)."""
        self.store.add(seq.params.cache_key, seq.tokens[seq.num_prompt:])


def to_draft(c: Candidate) -> Draft:
    return Draft(c.tokens, parents=c.parents)
