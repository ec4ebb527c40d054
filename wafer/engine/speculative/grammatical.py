"""A draft for a sequence under a grammar, cut to what the grammar accepts from where it stands.

The cut only saves rows: verification masks each position with the grammar's mask at the state
after the path accepted so far (as plain constrained decoding masks each step), so a token the
grammar forbids would be rejected there anyway. Validation does not advance the matcher; only the
tokens verification keeps are consumed, as they are appended (the target's own token included).
"""

from __future__ import annotations

from typing import Any

from wafer.engine.speculative.draft_tree import DraftTree
from wafer.engine.speculative.proposer import Draft


def grammatical(draft: Draft, matcher: Any) -> Draft:
    """`draft` cut by the grammar of `matcher` (llguidance's validate_tokens, which commits nothing):
    a chain to its longest accepted prefix; a tree to the nodes whose whole path from the root is
    accepted (each path validated; a kept node's ancestors are kept with it), in their order."""
    tokens = draft.tokens
    if not tokens:
        return draft
    if draft.parents is None:
        n = matcher.validate_tokens(tokens)
        if n == len(tokens):
            return draft
        return Draft(tokens[:n], draft.probs[:n] if draft.probs is not None else None)
    tree = DraftTree.of(len(tokens), draft.parents)
    ok = [False] * tree.size
    has_child = {p for p in tree.parents if p >= 0}
    for leaf in (i for i in range(tree.size) if i not in has_child):
        path = tree.path(leaf)
        for node in path[:matcher.validate_tokens([tokens[i] for i in path])]:
            ok[node] = True
    keep = [i for i in range(tree.size) if ok[i]]
    if len(keep) == tree.size:
        return draft
    where = {node: j for j, node in enumerate(keep)}
    parents = [where[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep]
    probs = draft.probs[keep] if draft.probs is not None else None
    if DraftTree.of(len(keep), parents).is_chain:
        return Draft([tokens[i] for i in keep], probs)
    return Draft([tokens[i] for i in keep], probs, parents)
