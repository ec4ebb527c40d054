"""Prompt lookup: drafts from the sequence's own text, no model needed."""

from __future__ import annotations

from wafer.engine.sequence import Sequence
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.proposer import Draft


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first) and propose the tokens that followed it: up to K after a match of n_max tokens, n after a
    shorter one. Each sequence keeps an index from n-gram to where it last ended, extended
    incrementally, so a step costs a few dictionary lookups."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.n_max, self.n_min = cfg.ngram_max, max(1, cfg.ngram_min)
        self._index: dict[int, tuple[list[dict[tuple[int, ...], int]], list[int]]] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        return [Draft(self._lookup(seq, k)) for seq, k in zip(seqs, limits)]

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.tokens
        tables, done = self._index.setdefault(seq.seq_id, ([{} for _ in range(self.n_max + 1)], [0]))
        last = len(tokens) - 1
        # Index every n-gram ending before the last token; the suffix itself must not match itself.
        for end in range(done[0], last):
            for n in range(self.n_min, self.n_max + 1):
                if end + 1 >= n:
                    tables[n][tuple(tokens[end + 1 - n : end + 1])] = end
        done[0] = max(done[0], last)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n:
                continue
            end = tables[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                # A shorter match is a weaker hint, and a long draft after it is mostly a step paid
                # for rows thrown away: on code edits, drafts after 4-token matches kept 7.1 of 8
                # tokens, after 2-token ones 2.0, half of them none. It proposes as many as it matched.
                limit = k if n == self.n_max else min(k, n)
                out = tokens[end + 1 : end + 1 + limit]
                # A match that ends fewer than `limit` tokens back has a continuation that runs into the
                # suffix itself: the text repeats with period `period` (rows of a table, runs of
                # indentation), and the proposal goes on repeating it rather than stop short.
                period = last - end
                while len(out) < limit:
                    out.append(out[len(out) - period])
                return out
        return []

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
