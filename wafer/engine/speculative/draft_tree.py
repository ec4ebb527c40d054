"""The shape of a draft verified in one step: a tree of candidate continuations of the sequence's
last token (a chain is the tree of one path).

A verifying step computes the last token and then every node, each in a row of its own and in a
KV position of its own: node i is written at position L + i, where L is the sequence's length
(its last token, the root, at L - 1). Its rotary position is its depth's, L - 1 + depth (its
place on its path), and it attends to the prefix (positions up to L - 1) and to its ancestors
and itself, nothing else: the logits of a node are those that decoding its path token by token
would give. Siblings, alternatives for one position, share their ancestors' rows. After the
verification the accepted path's KV rows move to L, L + 1, ...; on a chain they are there already.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    parents: tuple[int, ...]  # node i's parent, -1 for the root; a parent before its children
    depth: tuple[int, ...] = field(init=False)  # node i's distance from the root (1 for its children)

    def __post_init__(self) -> None:
        depth: list[int] = []
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"draft node {i}'s parent {parent} does not come before it")
            depth.append(1 if parent < 0 else depth[parent] + 1)
        object.__setattr__(self, "depth", tuple(depth))

    @classmethod
    def of(cls, n: int, parents: list[int] | None) -> DraftTree:
        """The tree of n nodes with these parents; None: a chain."""
        if parents is None:
            return cls(tuple(range(-1, n - 1)))
        if len(parents) != n:
            raise ValueError(f"a draft of {n} tokens with {len(parents)} parents")
        return cls(tuple(parents))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        """The nodes whose parent is `node` (-1: the root's), in order: the order they are tried in."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def first_path(self) -> list[int]:
        """The chain of first children from the root: the tree cut to one path."""
        out, node = [], -1
        while kids := self.children(node):
            node = kids[0]
            out.append(node)
        return out

    def positions(self, last: int) -> list[int]:
        """The nodes' rotary positions, the root (the last token) at `last`."""
        return [last + d for d in self.depth]

    def sees(self) -> torch.Tensor:
        """[n, n] bool: node i attends to node j (an ancestor of i, or i itself)."""
        n = self.size
        mask = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask


def tree_masks(start: int, own: int, tree: DraftTree, windows: set[int | None]) -> dict[int | None, torch.Tensor]:
    """Per attention window, the [own + n, start + own + n] mask of a step that computes `own`
    tokens of the sequence from `start` (its last one the root) and then the tree's n nodes: the
    sequence's tokens causally, each node the sequence and its own path. Distances for a window are
    counted in rotary positions, as the tokens of the accepted path will have them."""
    length = start + own  # L: the sequence's tokens, the root last
    n = tree.size
    ctx = length + n
    key_pos = torch.cat((torch.arange(length), torch.tensor(tree.positions(length - 1), dtype=torch.long)))
    query_pos = key_pos[start:]
    seen = torch.zeros(own + n, ctx, dtype=torch.bool)
    seen[:own, :length] = torch.arange(length).unsqueeze(0) <= torch.arange(start, length).unsqueeze(1)
    seen[own:, :length] = True
    seen[own:, length:] = tree.sees()
    return {w: seen if w is None else seen & (key_pos.unsqueeze(0) > query_pos.unsqueeze(1) - w) for w in windows}


def remap_rows(length: int, tree: DraftTree) -> list[list[int]]:
    """For the fused step, per node: [base, then the KV position of each rotary position from base
    up to the node's own]. Rotary positions from `base` on lie elsewhere than their number says
    (on a sibling's path); base is past the node's own position where its path lies in place (a
    chain's nodes, and the first path of a tree)."""
    out = []
    last = length - 1
    for i in range(tree.size):
        path = tree.path(i)
        where = [length + j for j in path]  # KV positions of rotary positions last + 1 ... last + depth
        moved = next((d for d, (node, _) in enumerate(zip(path, where)) if node != d), None)
        if moved is None:
            out.append([last + tree.depth[i] + 1])
        else:
            out.append([last + 1 + moved] + where[moved:])
    return out


def accepted_moves(length: int, path: list[int]) -> tuple[list[int], list[int]]:
    """Where the accepted path's KV rows are (node i at length + i) and where they go (length,
    length + 1, ...), for the rows that are not in place already."""
    src = [length + node for node in path]
    dst = [length + d for d in range(len(path))]
    moved = [(s, d) for s, d in zip(src, dst) if s != d]
    return [s for s, _ in moved], [d for _, d in moved]
