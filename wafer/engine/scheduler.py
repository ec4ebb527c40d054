"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every running sequence that has finished its prompt decodes one token per step. Prompts are
prefilled in chunks from a per-step token budget, so a long prompt never stalls the decoders.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from wafer.engine.kv_cache import KVCache
from wafer.engine.sequence import Sequence, Status


@dataclass(eq=False)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    count: int  # tokens computed this step, draft tokens included
    # Speculative tokens fed after the sequence's own: the step verifies them, one logits row each.
    draft: list[int] = field(default_factory=list)
    draft_probs: object = None  # [len(draft), vocab] tensor the draft was sampled from, or None
    rows: int = 1  # logits rows wanted, from the end of this step's tokens (1 + len(draft) to verify)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so its last logits give a token."""
        return self.start + self.count == len(self.seq.tokens) + len(self.draft)

    def input_ids(self) -> list[int]:
        """Tokens [start, start + count) of the sequence followed by its draft."""
        n = len(self.seq.tokens)
        if self.start >= n:
            return self.draft[self.start - n : self.start - n + self.count]
        return self.seq.tokens[self.start : self.start + self.count] + self.draft[: max(0, self.start + self.count - n)]


class Scheduler:
    def __init__(self, kv: KVCache, max_running: int, max_batched_tokens: int, prefix_caching: bool = True) -> None:
        self.kv = kv
        self.prefix_caching = prefix_caching
        self.max_running = min(max_running, kv.num_slots)
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None) -> list[ScheduledSeq]:
        """Decoders first (one token each), then prefill chunks while the budget lasts. With
        `prefill_cap`, prompts get at most that many tokens in a step that also decodes: the step's
        length is how long every decoder waits for its next token."""
        out: list[ScheduledSeq] = []
        budget = self.max_batched_tokens
        prefilling: list[Sequence] = []
        for seq in self.running:
            remaining = len(seq.tokens) - seq.num_cached
            if remaining == 1:
                out.append(ScheduledSeq(seq, seq.num_cached, 1))
                budget -= 1
            else:
                prefilling.append(seq)
        if out and prefill_cap is not None:
            budget = min(budget, prefill_cap)
        for seq in prefilling:
            if budget <= 0:
                break
            n = min(len(seq.tokens) - seq.num_cached, budget)
            out.append(ScheduledSeq(seq, seq.num_cached, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.kv.num_free:
            seq = self.waiting.popleft()
            seq.slot, reused = self.kv.allocate(seq.tokens if self.prefix_caching else None)
            seq.num_cached = seq.num_cached_prompt = reused
            seq.status = Status.RUNNING
            seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            n = min(len(seq.tokens) - seq.num_cached, budget)
            out.append(ScheduledSeq(seq, seq.num_cached, n))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and give its slot back."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            # Positions [0, num_cached) hold this sequence's KV: keep them warm for a later prefix.
            self.kv.free(seq.slot, seq.tokens[: seq.num_cached] if self.prefix_caching else None)
            seq.slot = None
