"""What speculative decoding has proposed and kept."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MethodStats:
    """One proposer's share: its drafts, their tokens, and those kept."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class SpecStats:
    """Counted as vLLM counts them: a draft is one proposal of one or more tokens for one sequence.
    Besides: the decoding steps of a sequence that could have carried a draft (`decode_steps`), how
    many drafts kept each number of tokens (`accepted_hist`), and the counts by proposer."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    decode_steps: int = 0  # a sequence decoding one token, or verifying a draft, in a step
    accepted_hist: list[int] = field(default_factory=list)  # [n]: drafts that kept n tokens
    by_method: dict[str, MethodStats] = field(default_factory=dict)
    grammar_cut_tokens: int = 0  # drafted tokens a sequence's grammar refused, cut before verification

    def record(self, proposed: int, accepted: int, method: str | None = None) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        while len(self.accepted_hist) <= accepted:
            self.accepted_hist.append(0)
        self.accepted_hist[accepted] += 1
        if method is not None:
            m = self.by_method.setdefault(method, MethodStats())
            m.drafts += 1
            m.draft_tokens += proposed
            m.accepted_tokens += accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields on average: 1 (the target's own) + accepted per draft."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
