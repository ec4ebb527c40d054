"""What a proposer gives and what the engine asks of one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from wafer.engine.sequence import Sequence


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree of candidate continuations verified in one step.

    `parents[i]` is node i's parent's index in `tokens`, -1 for the root (the sequence's last
    token); parents come before their children. None: a chain (parents -1, 0, 1, ...). Siblings
    are alternatives for the same position, tried in their order."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] each node was sampled from; None: deterministic
    parents: list[int] | None = None


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        """A draft for each sequence, of at most its limit of tokens."""
        ...

    def verified(self, seq: Sequence, start_len: int, accepted: int, proposed: int) -> None:
        """`accepted` of the `proposed` tokens after the sequence's first `start_len` were kept."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget the sequence (it ended, or was preempted and will be computed again)."""
        ...
