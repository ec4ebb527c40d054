"""Where text was seen before, and what followed it how often: the suffix tree of SuffixDecoding
(Oliaro et al. 2024; Snowflake's Arctic Inference, vLLM's `suffix` method), read from occurrences.

A suffix tree over earlier text holds, at the node of a context, how many times the context was
seen (its count) and, at each child, how many times each next token followed it. Drafting walks
from the node of the sequence's last tokens to the most frequent child while the product of the
counts' ratios (the path's estimated probability) stays above a floor, and the draft's score, the
sum of those probabilities, is the number of its tokens expected to be kept. The match length
bounds the draft (a longer context seen before is a surer guide), and of the match lengths the one
whose draft scores highest wins.

Here the counts are read from the occurrences themselves instead of a tree of nodes: each text is
indexed by the pairs of adjacent tokens in it (a pair's latest occurrences, newest last), the
occurrences of the sequence's last pair are extended backwards to their match length, and the
counts of a context of m tokens are those of the occurrences that match at least m. A tree of
Python objects with a node per token and depth (24 deep: 24 nodes a token) costs hundreds of bytes
a node; this costs one entry a token, and a step reads at most `max_occurrences` occurrences a store.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from wafer.config import SpeculationSettings

Occurrence = tuple[list[int], int, int, bool]  # (text, position of the pair's end, match length, is the live text)


@dataclass
class Candidate:
    """A proposal: tokens, each one's parent among them (-1: the root, the sequence's last token;
    None where the tokens are one path), each one's estimated probability, and their sum."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class PairIndex:
    """Texts and where each pair of adjacent tokens ends in them, at most `per_pair` occurrences a
    pair (the latest; the oldest go first). Texts are added whole and removed oldest first, so a
    removed text's occurrences are the oldest of each of its pairs."""

    def __init__(self, per_pair: int) -> None:
        self.per_pair = per_pair
        self.texts: dict[int, list[int]] = {}  # id -> tokens, oldest first
        self.where: dict[tuple[int, int], deque[tuple[int, int]]] = {}  # pair -> (text id, end), newest last
        self.tokens = 0

    def add(self, text_id: int, tokens: list[int]) -> None:
        self.texts[text_id] = tokens
        self.tokens += len(tokens)
        for end in range(1, len(tokens)):
            key = (tokens[end - 1], tokens[end])
            d = self.where.get(key)
            if d is None:
                d = self.where[key] = deque(maxlen=self.per_pair)
            d.append((text_id, end))

    def remove_oldest(self) -> int:
        """Drop the oldest text; returns its length."""
        text_id = next(iter(self.texts))
        tokens = self.texts.pop(text_id)
        self.tokens -= len(tokens)
        for end in range(1, len(tokens)):
            key = (tokens[end - 1], tokens[end])
            d = self.where.get(key)
            while d and d[0][0] == text_id:
                d.popleft()
            if d is not None and not d:
                del self.where[key]
        return len(tokens)

    def occurrences(self, a: int, b: int, limit: int) -> list[tuple[list[int], int]]:
        """The latest `limit` places the pair (a, b) ends, newest first."""
        d = self.where.get((a, b))
        if not d:
            return []
        out = []
        for text_id, end in reversed(d):
            out.append((self.texts[text_id], end))
            if len(out) == limit:
                break
        return out


class OutputStore:
    """Earlier requests' outputs, per key (a tenant's; None the shared one), at most `max_tokens`
    of them in all: the oldest output goes first, whatever its key. A key's requests draft only from
    that key's outputs."""

    def __init__(self, max_tokens: int, per_pair: int) -> None:
        self.max_tokens, self.per_pair = max_tokens, per_pair
        self.by_key: dict[str | None, PairIndex] = {}
        self._order: deque[str | None] = deque()  # the key of each stored output, oldest first
        self._next = 0
        self.tokens = 0

    def add(self, key: str | None, tokens: list[int]) -> None:
        if len(tokens) < 2 or self.max_tokens <= 0:
            return
        tokens = list(tokens[-self.max_tokens:])
        index = self.by_key.get(key)
        if index is None:
            index = self.by_key[key] = PairIndex(self.per_pair)
        index.add(self._next, tokens)
        self._next += 1
        self._order.append(key)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            old = self._order.popleft()
            self.tokens -= self.by_key[old].remove_oldest()
            if not self.by_key[old].texts:
                del self.by_key[old]

    def index(self, key: str | None) -> PairIndex | None:
        return self.by_key.get(key)


class LiveIndex:
    """A running sequence's own text (prompt and output so far), indexed as it grows: each pair's
    ends, newest last. The text is the sequence's own token list, read in place."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.where: dict[tuple[int, int], list[int]] = {}
        self.done = 1  # pairs ending before this are indexed

    def update(self) -> None:
        """Index every pair ending before the last token: the sequence's own suffix must not match itself."""
        t = self.tokens
        for end in range(self.done, len(t) - 1):
            self.where.setdefault((t[end - 1], t[end]), []).append(end)
        self.done = max(self.done, len(t) - 1)

    def occurrences(self, a: int, b: int, limit: int) -> list[int]:
        ends = self.where.get((a, b))
        return ends[-1 : -limit - 1 : -1] if ends else []


@dataclass
class SuffixParams:
    max_depth: int = SpeculationSettings.suffix_max_depth  # the longest match looked for (a suffix tree's depth)
    max_occurrences: int = 64  # per store a step reads: the latest
    spec_factor: float = 1.0  # a match of m tokens drafts at most spec_factor * m + spec_offset
    spec_offset: float = 0.0
    min_prob: float = SpeculationSettings.suffix_min_prob  # a token whose path's estimated probability falls below this ends the draft


def _next(occ: Occurrence, j: int, path: list[int]) -> int | None:
    """The token `j` places after the occurrence's end, along `path` (the tokens drafted after it
    so far): where the live text ends, its continuation is the draft itself (a match that ends
    fewer tokens back than the draft is long repeats with that period: rows, indentation)."""
    text, end, _, live = occ
    i = end + 1 + j
    if i < len(text):
        return text[i]
    if live and i - len(text) < len(path):
        return path[i - len(text)]
    return None


def speculate(context: list[int], live: LiveIndex | None, stored: PairIndex | None, k: int,
              p: SuffixParams, tree: bool = False) -> Candidate:
    """The best-scoring draft of at most k tokens after `context` from the occurrences of its last
    tokens in the live text and the stored outputs: a path, or with `tree` the most probable nodes
    of the continuations' tree (best first, each child under its parent)."""
    if k <= 0 or len(context) < 2:
        return Candidate()
    a, b = context[-2], context[-1]
    occs: list[Occurrence] = []
    sources: list[tuple[list[int], list[int], bool]] = []  # (text, ends, live)
    if live is not None:
        sources.append((live.tokens, live.occurrences(a, b, p.max_occurrences), True))
    for text, end in (stored.occurrences(a, b, p.max_occurrences) if stored is not None else []):
        sources.append((text, [end], False))
    n = len(context)
    for text, ends, is_live in sources:
        for end in ends:
            m = 2
            while m < p.max_depth and end - m >= 0 and m < n and text[end - m] == context[n - 1 - m]:
                m += 1
            occs.append((text, end, m, is_live))
    if not occs:
        return Candidate()
    best = Candidate()
    for m in sorted({o[2] for o in occs}, reverse=True):
        limit = min(k, int(m * p.spec_factor + p.spec_offset + 1e-6))
        if limit <= best.score:  # no draft of this length can score more (each token at most 1)
            break
        chosen = [o for o in occs if o[2] >= m]
        cand = _tree(chosen, limit, p.min_prob) if tree else _path(chosen, limit, p.min_prob)
        if cand.score > best.score:
            best = cand
            best.match_len = m
    return best


def _path(occs: list[Occurrence], limit: int, min_prob: float) -> Candidate:
    """The most frequent continuation, token by token, while its estimated probability holds."""
    out = Candidate()
    prob = 1.0
    while len(out.tokens) < limit and occs:
        j = len(out.tokens)
        counts: dict[int, int] = {}
        for o in occs:
            t = _next(o, j, out.tokens)
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        prob *= counts[token] / len(occs)
        if prob < min_prob:
            break
        occs = [o for o in occs if _next(o, j, out.tokens) == token]
        out.tokens.append(token)
        out.probs.append(prob)
        out.score += prob
    return out


def _tree(occs: list[Occurrence], limit: int, min_prob: float) -> Candidate:
    """The `limit` most probable nodes of the continuations' tree, each after its parent: a node's
    children are the tokens that followed its path, each as likely as the node times the share of
    the node's occurrences it continues."""
    out = Candidate(parents=[])
    parents: list[int] = out.parents  # type: ignore[assignment]
    # (-probability, tie-break (older first), occurrences through the node, its path, its parent's index)
    heap: list[tuple[float, int, list[Occurrence], list[int], int]] = []
    tie = 0

    def expand(node_occs: list[Occurrence], path: list[int], prob: float, index: int) -> None:
        nonlocal tie
        groups: dict[int, list[Occurrence]] = {}
        for o in node_occs:
            t = _next(o, len(path), path)
            if t is not None:
                groups.setdefault(t, []).append(o)
        for token, g in groups.items():
            p = prob * len(g) / len(node_occs)
            if p >= min_prob:
                heapq.heappush(heap, (-p, tie, g, path + [token], index))
                tie += 1

    expand(occs, [], 1.0, -1)
    while heap and len(out.tokens) < limit:
        neg, _, g, path, parent = heapq.heappop(heap)
        out.tokens.append(path[-1])
        parents.append(parent)
        out.probs.append(-neg)
        out.score += -neg
        expand(g, path, -neg, len(out.tokens) - 1)
    return out
