"""Verification: the target's logits over [last token, draft...] turned into the tokens it keeps.

The target's output stays exact: a greedy sequence keeps a draft token only where it is the
target's argmax; a sampled one keeps it with probability min(1, p/q) and otherwise draws from the
residual, which leaves the target's distribution unchanged (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wafer.engine.sampler import Sampler, best, token_logprob
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence, SequenceOutput, TokenLogprob

# Appends a token (and its logprob) to a sequence and says what the caller reads of it.
Append = Callable[[Sequence, int, TokenLogprob | None], SequenceOutput]


def verify(item: ScheduledSeq, rows: torch.Tensor, sampler: Sampler, append: Append) -> tuple[list[SequenceOutput], int]:
    """The sequence's new tokens from its rows (1 to len(draft)+1 of them, each appended as it is
    kept), and how many draft tokens were accepted. The sequence's num_cached follows: its KV holds
    its last token and the draft tokens accepted so far."""
    seq, draft = item.seq, item.draft
    p = seq.params
    start_len = len(seq.tokens)
    q = item.draft_probs
    raw_lp = torch.log_softmax(rows, dim=-1) if p.logprobs is not None else None
    fast = p.greedy and not p.needs_processing
    argmax = best(rows).tolist() if fast else []
    outs: list[SequenceOutput] = []
    accepted = 0
    for i in range(len(draft) + 1):
        proposed = draft[i] if i < len(draft) else None
        if fast:
            token = argmax[i]
        elif p.greedy or proposed is None:  # greedy keeps a draft only if it is the argmax anyway
            token = sampler.sample_row(rows[i], seq)
        else:
            token, _ = rejection_sample(sampler.processed(rows[i], seq), proposed,
                                        q[i] if q is not None else None, sampler.generator_for(seq))
        seq.num_cached = start_len + i
        lp = token_logprob(raw_lp[i], token, p.logprobs) if raw_lp is not None and p.logprobs is not None else None
        outs.append(append(seq, token, lp))
        if token != proposed or seq.finished:
            break
        accepted += 1
    return outs, accepted


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
