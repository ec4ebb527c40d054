"""A step's logits turned into each sequence's next tokens: grammar masks, the sampler (batched, row
by row where the batch fails), and drafts verified. A failure that belongs to one sequence (its
sampling parameters, its grammar) fails that sequence alone; the others go on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

from wafer.engine.constraints import GrammarTooCostly, mask_logits
from wafer.engine.executor import Fail
from wafer.engine.output_processor import OutputProcessor, merge
from wafer.engine.sampler import Sampler
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence, SequenceOutput, TokenLogprob
from wafer.engine.speculative.speculator import Speculator
from wafer.engine.stats import EngineStats

log = logging.getLogger("wafer.engine")
T = TypeVar("T")
# A constrained request's grammar budget (EngineConfig.grammar_seconds_per_token) counts at least
# this many tokens: its first masks and completion searches, which cost the most, fit in it.
BUDGET_HEADSTART = 50


class TokenPicker:
    def __init__(self, sampler: Sampler, speculator: Speculator, outputs: OutputProcessor, stats: EngineStats,
                 fail: Fail, grammar_seconds_per_token: float | None = None) -> None:
        self.sampler = sampler
        self.grammar_seconds_per_token = grammar_seconds_per_token
        self.speculator = speculator
        self.outputs = outputs
        self.stats = stats
        self.fail = fail

    def pick(self, plain: list[Sequence], rows: torch.Tensor, verifying: list[tuple[ScheduledSeq, torch.Tensor]],
             outputs: list[SequenceOutput]) -> None:
        """A token for each of `plain` from its row of `rows`, and 1 to len(draft)+1 for each item
        of `verifying` from its rows; their outputs join `outputs`."""
        self.stats.last_mask_seconds = self.stats.last_mask_cpu_seconds = 0.0
        if plain:
            self._mask(rows, plain, outputs)
            for seq, token, lp in self._sample(rows, plain, outputs):
                if (out := self._guard(seq, outputs, partial(self.outputs.append, seq, token, lp))) is not None:
                    outputs.append(out)
        for item, item_rows in verifying:
            mask = partial(self._mask_row, item.seq) if item.seq.matcher is not None else None
            verify = partial(self.speculator.verify, item, item_rows, self.sampler, self.outputs.append, mask)
            if made := self._guard(item.seq, outputs, verify):
                outputs.append(merge(made))

    def _mask(self, rows: torch.Tensor, seqs: list[Sequence], failed: list[SequenceOutput]) -> None:
        """Each constrained row's grammar mask, in place (_mask_row)."""
        for i, seq in enumerate(seqs):
            if seq.matcher is not None:
                self._guard(seq, failed, partial(self._mask_row, seq, rows[i]))

    def _mask_row(self, seq: Sequence, row: torch.Tensor) -> None:
        """The grammar's mask for the sequence's next token (the completion search's narrowing with
        the tokens left from here), in place, timed apart (EngineStats.last_mask_seconds) and
        charged to the request's grammar budget. Verification calls it for each row it samples."""
        tokens_left = seq.params.max_tokens - (len(seq.tokens) - seq.num_prompt)
        masking, cpu = time.perf_counter(), time.thread_time()
        mask_logits(row, seq.matcher, tokens_left)  # a failure fails the sequence alone (the caller's guard)
        spent = time.thread_time() - cpu
        self.stats.last_mask_cpu_seconds += spent
        self.stats.last_mask_seconds += time.perf_counter() - masking
        self._charge(seq, spent)

    def _charge(self, seq: Sequence, seconds: float) -> None:
        """Add a step's CPU seconds of grammar work (the mask, the completion search) to the request's
        count; GrammarTooCostly once that count passes grammar_seconds_per_token for each token it
        has generated (BUDGET_HEADSTART at least). CPU time of the stepping thread, which the
        machine's other load does not inflate: each of those seconds held every stream's step."""
        m = seq.matcher
        m.seconds += seconds
        rate = self.grammar_seconds_per_token
        generated = len(seq.tokens) - seq.num_prompt
        if rate and m.seconds > rate * max(generated, BUDGET_HEADSTART):
            raise GrammarTooCostly(
                f"the grammar of this request's schema took {m.seconds * 1000:.0f} ms of the engine's steps over "
                f"{generated} tokens, past its budget of {rate * 1000:.0f} ms a token (grammar_ms_per_token), while "
                "every other stream waited: simplify the schema (deep or recursive nesting, many optional keys)")

    def _sample(self, rows: torch.Tensor, seqs: list[Sequence], failed: list[SequenceOutput]
                ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """A token for each live row, in one batched call; row by row if that call fails."""
        live = [i for i, seq in enumerate(seqs) if not seq.finished]
        if len(live) == len(seqs):
            try:
                tokens, lps = self.sampler(rows, seqs)
                return list(zip(seqs, tokens, lps))
            except Exception:
                log.exception("batched sampling failed; sampling row by row")
        out = []
        for i in live:
            try:
                tokens, lps = self.sampler(rows[i : i + 1], [seqs[i]])
                out.append((seqs[i], tokens[0], lps[0]))
            except Exception as e:
                self.fail(seqs[i], e, failed)
        return out

    def _guard(self, seq: Sequence, failed: list[SequenceOutput], fn: Callable[[], T]) -> T | None:
        """fn(), or None with `seq` failed alone if it raises (or had failed already)."""
        if seq.finished:
            return None
        try:
            return fn()
        except Exception as e:
            self.fail(seq, e, failed)
            return None
