"""Turn a batch of logits into next tokens, one row per sequence, each with its own parameters."""

from __future__ import annotations

import bisect
import math

import torch

from wafer.engine.sequence import SeenTokens, Sequence, TokenLogprob
from wafer.kernels.build import kernels


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Repetition (over prompt and output, as vLLM and HF do), presence and frequency (over
    output, as OpenAI defines them) penalties and logit bias, on one row. No repetition penalty
    inside a tool call's or `response_format`'s JSON: its values are copied from the prompt (a city,
    a code the user gave), which the penalty would push the model off."""
    p = seq.params
    if p.repetition_penalty != 1.0 and not (seq.matcher is not None and seq.matcher.in_json()):
        if seq.seen is None:
            seq.seen = SeenTokens()
        ids = seq.seen.of(seq.tokens)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = seq.output_ids
        if out:
            ids, counts = torch.tensor(out, dtype=torch.long).unique(return_counts=True)
            logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    return logits


def tempered(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """logits / temperature, made safe to softmax: extreme penalties (repetition_penalty 1e-300 divides
    a logit to infinity) or temperatures must not make NaN probabilities, which would fail the whole
    step, so an infinite logit becomes the largest float and wins outright, as it would greedily, and
    a masked (-inf) or NaN one is masked. The kernels' top_candidates does the same."""
    return torch.nan_to_num(logits / temperature, nan=float("-inf"), neginf=float("-inf"),
                            posinf=torch.finfo(logits.dtype).max)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude; logits already divided by temperature."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


# Tokens looked at first when sampling: top-k, min-p and top-p keep far fewer than this at the usual
# settings, and then the draw is made among them (exactly the distribution the whole row gives, as
# nucleus() checks); a row whose kept set may reach past them is filtered whole (filter_logits).
CANDIDATES = 256


def nucleus(top: list[float], cum: list[float], top_k: int, top_p: float, min_p: float) -> int | None:
    """How many of a row's most probable tokens top-k, min-p and top-p keep, given `top` (its largest
    probabilities, in descending order, at temperature) and `cum` (their running sums); None when the
    kept set may reach past `top`, or when nothing filters the row. The same set as filter_logits.
    Plain lists and bisection: a few small tensor operations per row cost more than the rest."""
    k = len(top)
    if top_k > k:
        return None  # top-k keeps tokens past the candidates, whose mass top-p would need
    bounded = 0 < top_k
    n = top_k if bounded else k
    if min_p > 0.0:
        threshold = min_p * top[0]
        m = next((j for j in range(n) if top[j] < threshold), n)  # descending: those before it are kept
        if not bounded and m == k:
            return None  # tokens past the candidates may reach the threshold too
        n, bounded = m, True
    if top_p < 1.0:
        # The mass of what top-k and min-p kept: each token's share is taken within it, as
        # filter_logits takes the softmax of what they left. Unbounded, that is the whole row's.
        total = cum[n - 1] if bounded else 1.0
        if not bounded and cum[k - 1] < top_p:
            return None  # the nucleus may reach past the candidates
        limit = top_p * total
        n = max(1, next((j for j in range(n) if cum[j] - top[j] >= limit), n))  # the mass before a token rises
        bounded = True
    return n if bounded else None


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @torch.inference_mode()  # as the logits were made: so they can be changed in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [len(seqs), vocab] float32, which penalties may change in place. Returns the next
        token and its logprobs (of the raw logits) per row."""
        want_lp = [s.params.logprobs is not None for s in seqs]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if all(s.params.greedy for s in seqs):  # the common case: one reduction, one sync
            for i, seq in enumerate(seqs):
                if seq.params.needs_processing:
                    apply_penalties(logits[i], seq)  # in place: a step's logits are its scratch
            chosen = best(logits).tolist()
        else:
            chosen = self._sample_batch(logits, seqs)
        lps: list[TokenLogprob | None] = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            lps.append(None if raw_lp is None or k is None else token_logprob(raw_lp[i], chosen[i], k))
        return chosen, lps

    def _sample_batch(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """A token per row, greedy rows by argmax, the others drawn among their most probable tokens
        (nucleus()); the temperature, softmax and candidate search are one batched operation each,
        where a row at a time cost a sort of the vocabulary each (70 ms for 16 rows at top_p 0.9)."""
        if any(s.params.needs_processing for s in seqs):
            logits = logits.clone()  # the caller retries row by row on a failure: penalties once
            for i, seq in enumerate(seqs):
                if seq.params.needs_processing:
                    apply_penalties(logits[i], seq)
        chosen = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            for i, t in zip(greedy, best(logits[greedy]).tolist()):
                chosen[i] = t
        drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not drawn:
            return chosen
        temps = torch.tensor([seqs[i].params.temperature for i in drawn], dtype=logits.dtype)
        rows = logits if len(drawn) == logits.shape[0] else logits[drawn]
        scaled: torch.Tensor | None = None
        if (found := kernel_candidates(rows, temps)) is not None:
            top, idx = found
        else:
            scaled = tempered(rows, temps.unsqueeze(1))
            top, idx = scaled.softmax(-1).topk(min(CANDIDATES, rows.shape[-1]), dim=-1)

        def whole(r: int) -> torch.Tensor:  # row r tempered, where its candidates do not settle the draw
            return scaled[r] if scaled is not None else tempered(rows[r], temps[r])

        cum = top.cumsum(-1)
        top_l, cum_l, idx_l = top.tolist(), cum.tolist(), idx.tolist()
        for r, i in enumerate(drawn):
            p, gen = seqs[i].params, self.generator_for(seqs[i])
            if not math.isfinite(cum_l[r][-1]):  # every logit -inf: no token may follow
                raise ValueError(f"row {r} allows no token")
            n = nucleus(top_l[r], cum_l[r], p.top_k, p.top_p, p.min_p)
            if n is not None or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0):
                # By the cumulative distribution: among the kept candidates (renormalised), or, when
                # nothing filters the row, among the candidates first (most of the mass at the usual
                # temperatures) and the rest of the row only past them.
                mass = cum_l[r][n - 1] if n is not None else 1.0
                u = float(torch.rand((), generator=gen)) * mass
                j = bisect.bisect_right(cum_l[r], u, hi=n if n is not None else len(cum_l[r]))
                if n is not None or j < len(cum_l[r]):
                    chosen[i] = idx_l[r][min(j, (n or len(cum_l[r])) - 1)]
                else:
                    rest = whole(r).softmax(-1)
                    rest[idx[r]] = 0.0
                    tail = float(rest.sum()) > 0.0  # none when the candidates are the whole row
                    chosen[i] = int(torch.multinomial(rest, 1, generator=gen)) if tail else idx_l[r][-1]
            else:
                dist = filter_logits(whole(r), p.top_k, p.top_p, p.min_p).softmax(-1)
                chosen[i] = int(torch.multinomial(dist, 1, generator=gen))
        return chosen

    def processed(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """One row as this sequence samples from it: penalised logits when greedy, else probabilities."""
        p = seq.params
        if p.needs_processing:
            row = apply_penalties(row.clone(), seq)
        if p.greedy:
            return row
        if (kept := kept_distribution(row, p.temperature, p.top_k, p.top_p, p.min_p)) is not None:
            return kept
        # A row with nothing left (every logit masked) fails, its sequence alone, where it was once
        # drawn from uniformly.
        return filter_logits(tempered(row, p.temperature), p.top_k, p.top_p, p.min_p).softmax(-1)

    def sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        dist = self.processed(row, seq)
        if seq.params.greedy:
            return int(best(dist))
        return int(torch.multinomial(dist, 1, generator=self.generator_for(seq)))

    def generator_for(self, seq: Sequence) -> torch.Generator:
        return seq.generator or self.generator


def kernel_candidates(rows: torch.Tensor, temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's CANDIDATES most probable tokens at its temperature and their probabilities, as
    tempered(rows).softmax().topk() gives them, from wafer's kernel (two passes that read the rows,
    where torch's way makes four row-sized tensors); None where it does not run (another device or
    type, WAFER_KERNELS=off, a temperature that is not a positive finite number)."""
    ext = kernels() if rows.device.type == "cpu" and rows.dtype == torch.float32 else None
    if ext is None or rows.stride(-1) != 1 or not all(0.0 < t < math.inf for t in temps.tolist()):
        return None
    return ext.top_candidates(rows, temps.to(torch.float32), CANDIDATES)


def kept_distribution(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> torch.Tensor | None:
    """What filter_logits(tempered(row)).softmax() gives, from the row's candidates where top-k,
    top-p and min-p keep fewer than them: the kept tokens' probabilities, renormalised, and zeros.
    Speculative decoding verifies a sampled row position by position with it, where a sort of the
    vocabulary each cost milliseconds. None where the kernels are off or the kept set may reach past
    the candidates (or nothing is left): the whole row's way then."""
    if row.dim() != 1 or (found := kernel_candidates(row.view(1, -1), torch.tensor([temperature]))) is None:
        return None
    top, idx = found
    cum = top[0].cumsum(0)
    top_l, cum_l = top[0].tolist(), cum.tolist()
    if not math.isfinite(cum_l[-1]):
        return None
    n = nucleus(top_l, cum_l, top_k, top_p, min_p)
    if n is None:
        return None
    dist = torch.zeros_like(row)
    dist[idx[0, :n]] = top[0, :n] / cum[n - 1]
    return dist


def best(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension: the first largest value's index (a NaN's, if any), as
    `torch.max` gives it. On the CPU that is wafer's kernel where it is built: PyTorch's reduction
    runs on one thread (64 rows of 49152: 891 us, against 260; bench/step_parts.py). Elsewhere `max`,
    which is 3x faster than `argmax` over a vocabulary-sized row here."""
    ext = kernels() if logits.device.type == "cpu" else None
    if (ext is None or logits.dtype != torch.float32 or logits.dim() not in (1, 2) or logits.stride(-1) != 1
            or not logits.shape[-1]):
        return logits.max(dim=-1).indices
    return ext.argmax_rows(logits.view(-1, logits.shape[-1])).view(logits.shape[:-1])


# The least logprob reported: a token a grammar or a logit bias rules out has minus infinity, which
# JSON cannot carry (strict parsers refuse `-Infinity`); vLLM and OpenAI report -9999.0 for it.
LOGPROB_FLOOR = -9999.0


def token_logprob(row_logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The chosen token's logprob and the k best alternatives, from one row of log-softmax, each at
    least LOGPROB_FLOOR."""
    top = row_logprobs.topk(k) if k > 0 else None
    alts = [] if top is None else [(t, max(v, LOGPROB_FLOOR)) for t, v in zip(top.indices.tolist(), top.values.tolist())]
    return TokenLogprob(token, max(float(row_logprobs[token]), LOGPROB_FLOOR), alts)
