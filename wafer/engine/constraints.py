"""Grammar-constrained decoding with llguidance: a sequence whose parameters carry a grammar only
ever samples tokens the grammar allows, so tool arguments and JSON parse by construction."""

from __future__ import annotations

import torch
from llguidance import LLMatcher, LLTokenizer

from wafer.models.tokenizer import TextTokenizer


class GrammarError(ValueError):
    """The grammar (or the JSON Schema it came from) cannot be compiled."""


class Constraints:
    """The llguidance view of one tokenizer; makes a matcher per constrained sequence."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._llt: LLTokenizer | None = None

    @property
    def llt(self) -> LLTokenizer:
        if self._llt is None:  # about a second to build: only when a grammar is first used
            self._llt = LLTokenizer(self.tokenizer.tokenizer.to_str(), n_vocab=self.tokenizer.vocab_size,
                                    eos_token=self.tokenizer.eos_ids)
        return self._llt

    def check(self, grammar: str) -> None:
        error = LLMatcher.validate_grammar(grammar, self.llt)
        if error and not error.startswith("WARNING"):
            raise GrammarError(error)

    def matcher(self, grammar: str) -> LLMatcher:
        m = LLMatcher(self.llt, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m


def mask_logits(logits: torch.Tensor, matcher: LLMatcher) -> None:
    """Set every token the grammar forbids next to -inf, in place (one row)."""
    allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    n = min(allowed.numel(), logits.numel())
    logits[:n].masked_fill_(allowed[:n] == 0, float("-inf"))
    if logits.numel() > n:
        logits[n:] = float("-inf")
