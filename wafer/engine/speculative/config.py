"""Speculative decoding's settings for an engine, parsed from the CLI's and wafer.toml's spelling;
their defaults are wafer.config's SpeculationSettings."""

from __future__ import annotations

from dataclasses import dataclass

from wafer.config import SPECULATIVE_LENGTHS, SpeculationSettings


@dataclass
class SpeculativeConfig:
    method: str = SpeculationSettings.speculative  # off | ngram | draft
    num_tokens: int = SpeculationSettings.num_speculative_tokens  # K: tokens proposed per step
    draft_model: str | None = None  # for `draft`: a model name or path, resolved by whoever loads it
    ngram_max: int = SpeculationSettings.ngram_max
    ngram_min: int = SpeculationSettings.ngram_min
    max_running: int = SpeculationSettings.speculate_max_running
    # Choose each step's K (up to num_tokens, 0 included) by measured yield (DraftLength); False: always K.
    adaptive: bool = SpeculationSettings.speculative_length == "adaptive"

    @classmethod
    def parse(cls, spec: str | None, num_tokens: int = SpeculationSettings.num_speculative_tokens,
              length: str = SpeculationSettings.speculative_length) -> SpeculativeConfig:
        """`off`, `ngram` or `draft:MODEL`, as the CLI and wafer.toml spell it; `length`: `fixed` (K
        every step) or `adaptive` (up to K, by measured yield)."""
        spec = (spec or "off").strip()
        if num_tokens < 1:
            raise ValueError("the number of speculative tokens must be at least 1")
        if length not in SPECULATIVE_LENGTHS:
            raise ValueError(f"speculative length {length!r}: expected {' or '.join(SPECULATIVE_LENGTHS)}")
        adaptive = length == "adaptive"
        if spec in ("off", "ngram"):
            return cls(method=spec, num_tokens=num_tokens, adaptive=adaptive)
        if spec.startswith("draft:") and spec[len("draft:"):]:
            return cls(method="draft", num_tokens=num_tokens, draft_model=spec[len("draft:"):], adaptive=adaptive)
        raise ValueError(f"speculative method {spec!r}: expected off, ngram or draft:MODEL")

    @property
    def enabled(self) -> bool:
        return self.method != "off"
