"""Drafts from a smaller model with the target's vocabulary."""

from __future__ import annotations

import time

import torch

from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.engine.sampler import best, filter_logits
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence
from wafer.engine.speculative.proposer import Draft
from wafer.models.llama import LlamaModel


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
