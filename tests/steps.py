"""Driving a ModelRunner by hand: prompts prefilled into slots, then decode steps of all of them."""

from __future__ import annotations

import torch

from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import SamplingParams, Sequence


def prefill(runner: ModelRunner, kv: KVCache, prompts: list[list[int]]) -> list[Sequence]:
    """A slot per prompt holding the KV of all its tokens but the last, which the first decode step feeds."""
    seqs = []
    for p in prompts:
        seq = Sequence(list(p), SamplingParams())
        seq.slot, _ = kv.blocks.allocate()
        runner.run([ScheduledSeq(seq, 0, len(p) - 1)])
        seq.num_cached = len(p) - 1
        seqs.append(seq)
    return seqs


def decode_items(seqs: list[Sequence]) -> list[ScheduledSeq]:
    """One decode step of every sequence."""
    return [ScheduledSeq(s, s.num_cached, 1) for s in seqs]


def advance(seqs: list[Sequence], logits: torch.Tensor) -> None:
    """Append each sequence's greedy token from its row of the step's logits."""
    for s, row in zip(seqs, logits):
        s.tokens.append(int(row.argmax()))
        s.num_cached += 1
