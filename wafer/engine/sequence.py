"""Requests as the engine sees them: sampling parameters, sequences, and what a step returns."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

_ids = itertools.count()


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or less: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and k alternatives
    include_stop_str_in_output: bool = False
    grammar: str | None = None  # an llguidance grammar the output must follow
    # That grammar already compiled (an llguidance matcher in its start state), so that the step does
    # not compile it: each sequence gets a copy.
    compiled: Any = None
    # Draft by prompt lookup (n-gram) even where the engine does not speculate: for answers that copy
    # their input, as a synthesis of given results does. Costs no model; lossless like any draft.
    prompt_lookup: bool = False
    # Whose earlier outputs suffix drafts may draw on (a tenant's key); None: the shared store.
    cache_key: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def needs_processing(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


class SeenTokens:
    """The distinct tokens of a sequence so far, as the repetition penalty reads them: brought up to
    date with the tokens added since it last looked, not collected from the whole sequence at every
    step (which took about 0.9 ms a step at 8,000 tokens, for every sequence of the Qwen tiers, whose
    default penalty is 1.1)."""

    def __init__(self) -> None:
        self._upto = 0  # tokens looked at
        self._ids: set[int] = set()
        self._buf = torch.empty(0, dtype=torch.long)  # the distinct ids, in the order first seen
        self._n = 0

    def of(self, tokens: list[int]) -> torch.Tensor:
        if len(tokens) < self._upto:  # tokens only grow today; were some taken back, start again
            self.__init__()
        fresh: list[int] = []
        for t in tokens[self._upto :]:
            if t not in self._ids:
                self._ids.add(t)
                fresh.append(t)
        self._upto = len(tokens)
        if fresh:
            need = self._n + len(fresh)
            if need > self._buf.numel():
                grown = torch.empty(max(need, 2 * self._buf.numel(), 64), dtype=torch.long)
                grown[: self._n] = self._buf[: self._n]
                self._buf = grown
            self._buf[self._n : need] = torch.tensor(fresh, dtype=torch.long)
            self._n = need
        return self._buf[: self._n]


@dataclass(eq=False)
class Sequence:
    """One generation: its prompt, what it produced, and where its KV lives."""

    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(init=False)  # prompt then output
    status: Status = Status.WAITING
    slot: int | None = None
    num_cached: int = 0  # tokens whose K and V are in the cache
    num_cached_prompt: int = 0  # prompt tokens reused from an earlier request (prefix cache)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    text: str = ""  # output text so far, stop strings cut off
    emitted: int = 0  # characters of `text` already handed out
    logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    matcher: Any = None  # llguidance matcher when params.grammar is set
    seen: SeenTokens | None = None  # made at the first step with a repetition penalty
    # Batch work (the Batch API's lines): scheduled only where interactive sequences leave room
    # (scheduler.py), and preempted before them.
    background: bool = False

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class SequenceOutput:
    """What one step did for one sequence."""

    seq_id: int
    new_token_ids: list[int]
    text: str  # new text, safe to show (never part of a stop string or half a character)
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None  # seconds from arrival to first being scheduled
    error: str | None = None  # set when this sequence failed in the step (finish_reason "error")
