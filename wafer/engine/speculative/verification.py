"""Verification: the target's logits over [last token, draft nodes...] turned into the tokens it keeps.

A draft is a tree of candidates (a chain is its one-path case, draft_tree.py); verification walks
it from the root. At each node the target picks its token as plain decoding would, and the walk
goes on into the child that proposed that token. A greedy sequence thus keeps the longest path
whose every token is the target's argmax. A sampled one tries the node's children in turn
(SpecInfer's multi-step speculative sampling, Miao et al. 2024): child x with probability
min(1, p(x)/q(x)), and after each rejection p becomes the normalised residual max(0, p - q); when
every child is rejected the token is drawn from what is left. The token is then distributed
exactly as p (for one child, Leviathan et al. 2023's rejection sampling; for deterministic
candidates, q one-hot, each rejection takes the candidate out of p), so the output is the
target's whatever the draft.

Under a grammar each row is masked, just before its token is picked, with the grammar's mask at the
state the path kept so far leaves (the caller's `mask`; the matcher consumes each token as it is
appended): every position is picked as plain constrained decoding would pick it there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wafer.engine.sampler import Sampler, best, token_logprob
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence, SequenceOutput, TokenLogprob
from wafer.engine.speculative.draft_tree import DraftTree

# Appends a token (and its logprob) to a sequence and says what the caller reads of it.
Append = Callable[[Sequence, int, TokenLogprob | None], SequenceOutput]
# Masks a row in place as the sequence's grammar allows from where the sequence stands now.
Mask = Callable[[torch.Tensor], None]


def verify(item: ScheduledSeq, rows: torch.Tensor, sampler: Sampler, append: Append,
           mask: Mask | None = None) -> tuple[list[SequenceOutput], list[int]]:
    """The sequence's new tokens from its rows (row 0 the last token's, row 1 + i node i's), each
    appended as it is kept, and the accepted path: the draft's nodes kept, from the root down. The
    sequence's num_cached follows: its KV holds its last token and the path so far. `mask`: the
    sequence's grammar, applied to a row (in place) when the walk reaches it."""
    seq, draft = item.seq, item.draft
    tree = item.tree or DraftTree.of(len(draft), None)
    p = seq.params
    start_len = len(seq.tokens)
    q = item.draft_probs
    # A masked row's logprobs are of the row as masked (as plain decoding reports them): taken per row.
    raw_lp = torch.log_softmax(rows, dim=-1) if p.logprobs is not None and mask is None else None
    fast = p.greedy and not p.needs_processing and mask is None
    argmax = best(rows).tolist() if fast else []
    outs: list[SequenceOutput] = []
    path: list[int] = []
    node = -1  # the root: the sequence's last token
    while True:
        row = node + 1
        kids = tree.children(node)
        if mask is not None:
            mask(rows[row])
        if fast:
            token = argmax[row]
        elif p.greedy or not kids:  # greedy keeps a draft only if it is the argmax anyway
            token = sampler.sample_row(rows[row], seq)
        else:
            token, _ = rejection_sample(sampler.processed(rows[row], seq), [draft[c] for c in kids],
                                        [q[c] for c in kids] if q is not None else None, sampler.generator_for(seq))
        seq.num_cached = start_len + len(path)
        lp = None
        if p.logprobs is not None:
            row_lp = raw_lp[row] if raw_lp is not None else torch.log_softmax(rows[row], dim=-1)
            lp = token_logprob(row_lp, token, p.logprobs)
        outs.append(append(seq, token, lp))
        # The child that proposed the token (after a rejection of all, the residual gives none of them).
        node = next((c for c in kids if draft[c] == token), -1)
        if node < 0 or seq.finished:
            break
        path.append(node)
    return outs, path


def rejection_sample(p: torch.Tensor, tokens: list[int], q: list[torch.Tensor] | None,
                     gen: torch.Generator) -> tuple[int, int | None]:
    """A token distributed exactly as p, given candidates `tokens` tried in turn: candidate x with
    probability min(1, p(x)/q(x)) against the current p, which after each rejection becomes the
    normalised residual max(0, p - q) (SpecInfer). `q` None means the candidates were chosen
    deterministically (each q one-hot): a rejection takes the candidate out of p. Candidates
    sampled from a distribution must be drawn independently from theirs. Returns the token and
    the index of the candidate kept (None: every one was rejected, the token drawn from the rest)."""
    for i, token in enumerate(tokens):
        qi = q[i] if q is not None else None
        qd = 1.0 if qi is None else float(qi[token])
        pd = float(p[token])
        if qd > 0.0 and float(torch.rand((), generator=gen)) * qd < pd:
            return token, i
        if qi is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - qi).clamp_min(0.0)
        mass = float(residual.sum())
        if mass > 0.0:  # (else p and q agree to rounding: any draw from p will do)
            p = residual / mass
    return int(torch.multinomial(p, 1, generator=gen)), None
