"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every running sequence that has finished its prompt decodes one token per step. Prompts are
prefilled in chunks from a per-step budget of tokens and of work, so a long prompt never stalls the
decoders.

Background sequences (the Batch API's lines) run only where interactive ones leave room: they wait
behind every interactive sequence, are admitted only in a step that has no interactive prompt to
read, sit out (keeping their blocks) every step that has one, and are preempted first, for an
interactive sequence's slot or blocks. An interactive request's first token so waits for no batch
work but the step in flight when it came.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from wafer.config import CacheSettings
from wafer.engine.block_manager import BlockManager
from wafer.engine.kv_layout import BLOCK
from wafer.engine.sequence import Sequence, Status
from wafer.engine.speculative.draft_tree import DraftTree
from wafer.engine.step_cost import positions_of, tokens_within

# A prompt that gets a chunk in a step gets at least this many of its tokens (or its rest), however
# little of the step's prompt work is left, unless that many at its position cost more than
# FLOOR_OVERRUN times the step's prompt work; and a step's prompt work is never less than this many
# tokens at position 0. A step costs its decoders, its sampling and its loop's turn whatever its
# chunk: in chunks of 8 a long prompt pays that many times over, and the streams beside it, each step
# a token, wait through all of those steps.
MIN_CHUNK = 32
# How far past the step's prompt work a chunk may go to read MIN_CHUNK tokens. Deep in a long context
# a token costs several times what it costs at position 0, and a floor counted in tokens alone held
# the server's loop for two and more times the step's budget.
FLOOR_OVERRUN = 1.5
# The share of a step's prompt work (prefill_step_ms) that background prompts may take: a step is
# what an interactive request that arrives during it waits for before its own prompt is read, and
# batch work keeps those steps short.
BACKGROUND_PROMPT_SHARE = 0.25


@dataclass(eq=False)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    count: int  # tokens computed this step, draft tokens included
    # Speculative tokens fed after the sequence's own: the step verifies them, one logits row each.
    draft: list[int] = field(default_factory=list)
    draft_probs: object = None  # [len(draft), vocab] tensor the draft was sampled from, or None
    tree: DraftTree | None = None  # the draft's shape where it is not a chain (draft_tree.py)
    rows: int = 1  # logits rows wanted, from the end of this step's tokens (1 + len(draft) to verify)

    @property
    def slot(self) -> int:
        """The sequence's KV slot: a scheduled sequence holds one."""
        assert self.seq.slot is not None, "a scheduled sequence holds a slot"
        return self.seq.slot

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so its last logits give a token."""
        return self.start + self.count == len(self.seq.tokens) + len(self.draft)

    def positions(self) -> list[int]:
        """The rotary positions of this step's tokens: their KV positions, but for a tree's nodes,
        which take their depth's (draft_tree.py)."""
        if self.tree is None:
            return list(range(self.start, self.start + self.count))
        own = self.count - len(self.draft)
        return list(range(self.start, self.start + own)) + self.tree.positions(self.start + own - 1)

    def input_ids(self) -> list[int]:
        """Tokens [start, start + count) of the sequence followed by its draft."""
        n = len(self.seq.tokens)
        if self.start >= n:
            return self.draft[self.start - n : self.start - n + self.count]
        return self.seq.tokens[self.start : self.start + self.count] + self.draft[: max(0, self.start + self.count - n)]


# A prompt that shares this many blocks (beyond those already cached) with a prompt being computed in
# this step waits one step and reuses them, rather than computing them a second time beside it: what
# a burst of requests with one system prompt, or Ultra's sub-agents, would otherwise do (SGLang's
# in-batch prefix caching does the same).
SHARED_BLOCKS_TO_WAIT = 2


def _computed_beside(seq: Sequence, scheduled: list[ScheduledSeq]) -> bool:
    """Whether a prompt chunk in `scheduled` computes, in this step, SHARED_BLOCKS_TO_WAIT or more
    whole blocks of `seq`'s prompt that no cached block holds yet (its last token aside, which is
    always computed)."""
    limit = len(seq.tokens) - 1
    for s in scheduled:
        if s.count <= 1:
            continue
        t = (s.start // BLOCK + SHARED_BLOCKS_TO_WAIT) * BLOCK  # blocks before its start are cached for both
        if t <= min(limit, s.start + s.count) and seq.tokens[:t] == s.seq.tokens[:t]:
            return True
    return False


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_batched_tokens: int,
                 prefix_caching: bool = CacheSettings.prefix_caching) -> None:
        self.blocks = blocks
        self.prefix_caching = prefix_caching
        self.max_running = min(max_running, blocks.num_slots)
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted: list[Sequence] = []  # since the engine last looked (it drops their drafts' state)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq`: an interactive one after the interactive ones waiting, before any background one."""
        if seq.background:
            self.waiting.append(seq)
        else:
            self.waiting.insert(self._interactive_waiting(), seq)

    def _interactive_waiting(self) -> int:
        """How many interactive sequences wait (they are the head of the queue)."""
        n = 0
        for seq in self.waiting:
            if seq.background:
                break
            n += 1
        return n

    def _interactive_prompt(self) -> bool:
        """Whether an interactive sequence waits or has prompt tokens left to compute: then no step
        carries background work, which would lengthen the steps that lead to its first token."""
        return (bool(self.waiting) and not self.waiting[0].background) or any(
            not seq.background and len(seq.tokens) - seq.num_cached > 1 for seq in self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None, busy: frozenset[int] | set[int] = frozenset(),
                 max_seqs: int | None = None, per_position: float = 0.0,
                 decode_rows: int | None = None) -> list[ScheduledSeq]:
        """Decoders first (one token each), then prefill chunks while the budget lasts. With
        `prefill_cap`, prompts get at most that much work in a step, counted in tokens at position 0
        where a token at position p costs 1 + p * per_position of them (step_cost.py): the step's
        length is how long every decoder waits for its next token, and how long the server's loop,
        which steps the engine, answers no one. A prompt that gets a chunk gets at least MIN_CHUNK
        tokens of it, or what FLOOR_OVERRUN times the step's prompt work buys at its position.

        Running sequences are served in the order they were admitted, interactive ones first. When
        the cache has no block for one of them, a background sequence is preempted, else the one admitted last: its blocks go back (its full ones
        stay findable as a cached prefix) and it waits at the head of the queue to be computed
        again, as vLLM does.

        With pipeline stages several steps are in flight: the sequences of those (`busy`, by id) are
        left out, neither scheduled nor preempted, and a step takes at most `max_seqs` sequences so
        that the running ones are shared among the steps.

        With `decode_rows`, background sequences decode only while the step has fewer decoders than
        that (one at least, so that batch work moves); the others sit the step out (background_pace.py)."""
        out: list[ScheduledSeq] = []
        room = max_seqs if max_seqs is not None else len(self.running) + len(self.waiting)
        budget = self.max_batched_tokens
        prefilling: list[Sequence] = []
        urgent = self._interactive_prompt()
        background_rows = 0  # background decoders in this step
        # Interactive sequences first (each kind in the order admitted): they take the blocks there are
        # before batch work is scheduled, and so cannot be preempted for it.
        for seq in sorted(self.running, key=lambda s: s.background):
            if seq.status is not Status.RUNNING or seq.seq_id in busy:  # (or preempted earlier in this loop)
                continue
            if urgent and seq.background:  # sits this step out, its blocks kept
                continue
            if len(out) + len(prefilling) >= room:
                break
            if len(seq.tokens) - seq.num_cached == 1:
                if seq.background and decode_rows is not None and len(out) >= decode_rows and background_rows:
                    continue  # sits this step out, its blocks kept
                if self._make_room(seq, seq.num_cached + 1, out, busy):
                    background_rows += seq.background
                    self.blocks.reserve(seq.slot, seq.num_cached + 1)  # type: ignore[arg-type]
                    out.append(ScheduledSeq(seq, seq.num_cached, 1))
                    budget -= 1
            else:
                prefilling.append(seq)
        work = float(max(MIN_CHUNK, prefill_cap)) if prefill_cap is not None else math.inf
        background_work = work * BACKGROUND_PROMPT_SHARE
        overrun = work * (FLOOR_OVERRUN - 1)  # the prompt work chunks of the floor may add past the step's

        def within(start: int, background: bool) -> int:  # prompt tokens from `start` that the work left allows
            left = min(work, background_work) if background else work
            if left == math.inf:
                return budget
            floor = min(MIN_CHUNK, tokens_within(left + overrun, start, per_position))
            return max(floor, tokens_within(left, start, per_position))

        def spend(start: int, n: int, background: bool) -> None:
            nonlocal budget, work, background_work
            budget -= n
            cost = n + per_position * positions_of(start, n)
            work -= cost
            if background:
                background_work -= cost

        for seq in prefilling:
            if budget <= 0 or work <= 0:
                break
            if seq.status is not Status.RUNNING or (seq.background and background_work <= 0):
                continue
            n = self._chunk(seq, min(budget, within(seq.num_cached, seq.background)), out, busy)
            if n:
                self.blocks.reserve(seq.slot, seq.num_cached + n)  # type: ignore[arg-type]
                out.append(ScheduledSeq(seq, seq.num_cached, n))
                spend(seq.num_cached, n, seq.background)
        # With steps in flight (pipeline stages) the blocks a step computes are indexed only when it
        # comes back, after the next step is scheduled: waiting for them there would gain nothing.
        wait_for_shared = self.prefix_caching and not busy
        held: list[Sequence] = []  # waiting a step for blocks computed in this one; the rest go on
        while self.waiting and budget > 0 and work > 0 and len(out) < room:
            seq = self.waiting[0]
            if seq.background and (urgent or background_work <= 0 or any(not h.background for h in held)):
                break  # batch work is admitted only in a step with no interactive prompt, within its share
            if len(self.running) >= self.max_running or not self.blocks.num_free:
                if not seq.background and self._preempt_background(out, busy):
                    continue  # an interactive sequence takes a background one's slot or blocks
                break
            if wait_for_shared and _computed_beside(seq, out):
                held.append(self.waiting.popleft())
                continue
            slot, reused = self.blocks.allocate(seq.tokens if self.prefix_caching else None)
            n = min(len(seq.tokens) - reused, budget, within(reused, seq.background),
                    self.blocks.room(slot, len(seq.tokens)) - reused)
            if n <= 0:  # not a block free for it: it waits for a sequence to end, or takes a background one's
                self.blocks.free(slot)
                if not seq.background and self._preempt_background(out, busy):
                    continue
                break
            self.waiting.popleft()
            self.blocks.reserve(slot, reused + n)
            seq.slot, seq.num_cached = slot, reused
            if seq.first_scheduled_time is None:  # (a preempted sequence keeps its first admission)
                seq.num_cached_prompt = reused
                seq.first_scheduled_time = time.monotonic()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, seq.num_cached, n))
            spend(reused, n, seq.background)
        self.waiting.extendleft(reversed(held))  # at the head, in their order
        return out

    def _make_room(self, seq: Sequence, n: int, scheduled: list[ScheduledSeq],
                   busy: frozenset[int] | set[int]) -> bool:
        """Blocks for `seq`'s first n tokens, preempting sequences admitted after it (and not
        already in this step) as needed. False when none is left to preempt: then `seq` itself is
        preempted if it is the last admitted and not alone, so that the others can go on."""
        while self.blocks.room(seq.slot, n) < n:  # type: ignore[arg-type]
            victim = self._background_victim(seq, scheduled, busy)
            if victim is None:
                victim = self.running[-1]
                if victim is seq:
                    if len(self.running) > 1:
                        self.preempt(seq)
                    return False
                if seq.background and not victim.background:  # batch work never preempts interactive work
                    self.preempt(seq)
                    return False
                if any(item.seq is victim for item in scheduled) or victim.seq_id in busy:
                    return False
            self.preempt(victim)
        return True

    def _background_victim(self, seq: Sequence | None, scheduled: list[ScheduledSeq],
                           busy: frozenset[int] | set[int]) -> Sequence | None:
        """The background sequence to preempt first: the last admitted, neither in this step nor in
        one in flight; for a background `seq`, only one admitted after it."""
        for other in reversed(self.running):
            if other is seq:
                if seq.background:
                    return None
                continue
            if other.background and other.seq_id not in busy and not any(item.seq is other for item in scheduled):
                return other
        return None

    def _preempt_background(self, scheduled: list[ScheduledSeq], busy: frozenset[int] | set[int]) -> bool:
        """Preempt a background sequence for a waiting interactive one; False when none can be."""
        victim = self._background_victim(None, scheduled, busy)
        if victim is None:
            return False
        self.preempt(victim)
        return True

    def _chunk(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq],
               busy: frozenset[int] | set[int]) -> int:
        """How many prompt tokens `seq` computes this step: its remainder, within the budget and the
        blocks it can get (preempting later sequences only when it could not advance at all)."""
        start = seq.num_cached
        n = min(len(seq.tokens) - start, budget)
        fit = self.blocks.room(seq.slot, start + n) - start  # type: ignore[arg-type]
        if fit > 0:
            return min(n, fit)
        return min(n, BLOCK) if self._make_room(seq, start + min(n, BLOCK), scheduled, busy) else 0

    def preempt(self, seq: Sequence) -> None:
        """Stop a running sequence and free its blocks; it will be computed again from its tokens."""
        self.running.remove(seq)
        self.blocks.free(seq.slot)  # type: ignore[arg-type]
        seq.slot, seq.num_cached = None, 0
        seq.status = Status.WAITING
        if seq.background:  # at the head of the background ones
            self.waiting.insert(self._interactive_waiting(), seq)
        else:
            self.waiting.appendleft(seq)
        self.preempted.append(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and give its slot back."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            # Its full blocks stay findable as a cached prefix until their storage is needed.
            self.blocks.free(seq.slot)
            seq.slot = None
