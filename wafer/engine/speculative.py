"""Speculative decoding: propose several tokens cheaply, verify them in one step of the real model.

Two proposers. `NgramProposer` looks the sequence's last few tokens up in its own prompt and
output and proposes what followed them there (prompt lookup: no extra model, strong when the answer
copies its input). `DraftModelProposer` runs a smaller model with the same vocabulary for K steps.
Verification keeps the target's output exact: greedy sequences keep a draft token only where it is
the target's argmax; sampled ones use standard rejection sampling, which leaves the target's
distribution unchanged (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from wafer.engine.kv_cache import KVCache
from wafer.engine.runner import ModelRunner
from wafer.engine.sampler import best, filter_logits
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence
from wafer.models.llama import LlamaModel


@dataclass
class SpeculativeConfig:
    method: str = "off"  # off | ngram | draft
    num_tokens: int = 5  # K: tokens proposed per step
    draft_model: str | None = None  # for `draft`: a model name or path, resolved by whoever loads it
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix that counts as a match
    max_running: int = 4  # speculate only while at most this many sequences run
    # Choose each step's K (up to num_tokens, 0 included) by measured yield (DraftLength); False: always K.
    adaptive: bool = False

    @classmethod
    def parse(cls, spec: str | None, num_tokens: int = 5, length: str = "fixed") -> SpeculativeConfig:
        """`off`, `ngram` or `draft:MODEL`, as the CLI and wafer.toml spell it; `length`: `fixed` (K
        every step) or `adaptive` (up to K, by measured yield)."""
        spec = (spec or "off").strip()
        if num_tokens < 1:
            raise ValueError("the number of speculative tokens must be at least 1")
        if length not in ("fixed", "adaptive"):
            raise ValueError(f"speculative length {length!r}: expected fixed or adaptive")
        adaptive = length == "adaptive"
        if spec in ("off", "ngram"):
            return cls(method=spec, num_tokens=num_tokens, adaptive=adaptive)
        if spec.startswith("draft:") and spec[len("draft:"):]:
            return cls(method="draft", num_tokens=num_tokens, draft_model=spec[len("draft:"):], adaptive=adaptive)
        raise ValueError(f"speculative method {spec!r}: expected off, ngram or draft:MODEL")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass
class SpecStats:
    """Counted as vLLM counts them: a draft is one proposal of one or more tokens for one sequence."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields on average: 1 (the target's own) + accepted per draft."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class DraftLength:
    """Each step's draft length, chosen by what steps with each length yielded: tokens per second of
    the whole step, proposing included. Whether speculation pays depends on the machine and the
    text: where verifying a row costs nearly as much as a step (a model bound by compute, as on two
    cores) or the drafts are seldom right, fewer tokens, or none, decode faster than K; where rows
    are cheap (bound by memory bandwidth), K does. A hill climb over a few lengths: the best measured
    length, and every `explore`-th step one of its neighbours, so that a change of text or load is
    followed. Yields are moving averages, so one noisy step moves them only part way.

    They are kept per context: the number of sequences in the step, whose cost and yield change
    with it, and whether the step before kept its drafts whole. An answer that copies its input
    runs in stretches: after a draft kept whole the next is likely kept too (a long draft pays),
    after one cut short the text has turned from its source (a short one, or none, does). One climb
    over both would chase whichever stretch it is in and lag behind the other."""

    def __init__(self, k_max: int, explore: int = 6, alpha: float = 0.3) -> None:
        self.lengths = sorted({0, k_max, *(k for k in (1, 2, 4, 8, 16) if k < k_max)})
        # (sequences in the step, the step before kept its drafts whole) -> length -> yield
        self.by_context: dict[tuple[int, bool], dict[int, float]] = {}
        self.chosen: dict[int, int] = {k: 0 for k in self.lengths}  # steps given each length
        self.explore, self.alpha = explore, alpha
        self.steps = 0
        self._upward = False

    def yields(self, batch: int = 1, kept: bool = False) -> dict[int, float]:
        return self.by_context.get((batch, kept), {})

    def best(self, batch: int = 1, kept: bool = False) -> int:
        """The length of the highest measured yield in this context; K until one is measured."""
        ys = self.yields(batch, kept)
        return max(ys, key=ys.__getitem__) if ys else self.lengths[-1]

    def choose(self, batch: int = 1, kept: bool = False) -> int:
        self.steps += 1
        i = self.lengths.index(self.best(batch, kept))
        if self.steps % self.explore:
            k = self.lengths[i]
        else:
            self._upward = not self._upward
            j = i + 1 if self._upward else i - 1
            if not 0 <= j < len(self.lengths):  # at an end: the one neighbour there is
                j = i - 1 if self._upward else i + 1
            k = self.lengths[j]
        self.chosen[k] += 1
        return k

    def record(self, k: int, tokens: int, seconds: float, batch: int = 1, kept: bool = False) -> None:
        """A step of `batch` sequences decoded with draft length k in context `kept` (as chosen):
        `tokens` new tokens in `seconds`."""
        if seconds <= 0 or k not in self.lengths:
            return
        y = tokens / seconds
        ys = self.by_context.setdefault((batch, kept), {})
        old = ys.get(k)
        ys[k] = y if old is None else old + self.alpha * (y - old)


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] the draft sampled from; None: deterministic


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


class DraftModelProposer:
    """A smaller model with the target's vocabulary proposes K tokens, one batched step each.

    It keeps its own KV cache with the target's slot layout (a sequence uses the same slot index in
    both), and remembers how many of each sequence's tokens that cache holds, so after a
    verification it only computes what it has not seen: usually the target's one new token."""

    def __init__(self, model: LlamaModel, num_slots: int, max_len: int, seed: int | None = None) -> None:
        self.model = model
        # Its positions are written again after a rejection and never passed on as done, so its
        # windowed layers (if any) keep every token.
        self.kv = KVCache.for_model(model, num_slots, max_len, window_pool=0)
        self.runner = ModelRunner(model, self.kv)
        self.cached: dict[int, int] = {}  # seq_id -> leading tokens whose KV the draft cache holds
        self.catch_up_seconds = 0.0  # of the last proposal: computing tokens decoded without the draft
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # Tokens decoded without proposals (steps of length 0, a cached prefix) first, in a call of
        # their own, timed, so that a measure of what a draft length yields can leave them out. (Two
        # tokens behind is the usual: the last draft token and the target's own, after a full accept.)
        started = time.perf_counter()
        behind = [ScheduledSeq(seq, c, len(seq.tokens) - 1 - c) for seq in seqs
                  if (c := self.cached.get(seq.seq_id, 0)) < len(seq.tokens) - 2]
        self._compute(behind)
        self.catch_up_seconds = time.perf_counter() - started if behind else 0.0
        for j in range(max(limits, default=0)):
            items, idx = [], []
            for i, (seq, k) in enumerate(zip(seqs, limits)):
                if j >= k:
                    continue
                if j == 0:  # catch up on what the target accepted since last time
                    start = self.cached.get(seq.seq_id, 0)
                    items.append(ScheduledSeq(seq, start, len(seq.tokens) - start))
                else:  # feed the previous proposal
                    items.append(ScheduledSeq(seq, len(seq.tokens) + j - 1, 1, draft=list(drafts[i])))
                idx.append(i)
            logits = self.runner.run(items)
            for row, i in enumerate(idx):
                seq = seqs[i]
                p = seq.params
                if p.greedy:
                    drafts[i].append(int(best(logits[row])))
                    continue
                q = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
                drafts[i].append(int(torch.multinomial(q, 1, generator=seq.generator or self.generator)))
                probs[i].append(q)
        out = []
        for seq, d, q in zip(seqs, drafts, probs):
            # The draft's KV now covers the sequence and every proposed token but the last.
            self.cached[seq.seq_id] = len(seq.tokens) + max(len(d) - 1, 0)
            out.append(Draft(d, torch.stack(q) if q else None))
        return out

    def follow_prompt(self, items: list[ScheduledSeq]) -> None:
        """Compute as many prompt tokens as the target computed this step, from wherever the draft's
        cache ends. The draft's prompt work then counts in the prompt's time, as the target's does,
        instead of stalling the stream at its first proposal for as long as a prefill takes; and a
        step's work per prompt token, which sizes the next chunks, stays the two models' for one
        token. (A prefix the target took from its cache is the draft's to catch up on at its first
        proposal.)"""
        work = []
        for item in items:
            start = self.cached.get(item.seq.seq_id, 0)
            end = min(start + item.count, item.start + item.count, item.seq.num_prompt)
            if end > start:
                work.append(ScheduledSeq(item.seq, start, end - start))
        self._compute(work)

    def _compute(self, work: list[ScheduledSeq]) -> None:
        """Tokens of the sequences into the draft's KV cache, none sampled."""
        if work:
            self.runner.run(work)
            for w in work:
                self.cached[w.seq.seq_id] = w.start + w.count

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        # Draft KV past the accepted tokens belongs to rejected proposals: forget it.
        self.cached[seq.seq_id] = start_len + min(accepted, proposed - 1)

    def release(self, seq_id: int) -> None:
        self.cached.pop(seq_id, None)


Proposer = NgramProposer | DraftModelProposer


def rejection_sample(p: torch.Tensor, token: int, q: torch.Tensor | None, gen: torch.Generator) -> tuple[int, bool]:
    """Keep the proposed `token` with probability min(1, p/q); otherwise draw from the normalised
    residual max(0, p - q). `q` None means the proposal was deterministic (q is one-hot on
    `token`). The returned token is distributed exactly as p. Returns (token, accepted)."""
    qd = 1.0 if q is None else float(q[token])
    pd = float(p[token])
    if qd > 0.0 and float(torch.rand((), generator=gen)) * qd < pd:
        return token, True
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p and q agree to rounding: any draw from p will do
        residual = p
    return int(torch.multinomial(residual, 1, generator=gen)), False
