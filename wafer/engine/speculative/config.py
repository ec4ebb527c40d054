"""Speculative decoding's settings, as the CLI and wafer.toml spell them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    method: str = "off"  # off | ngram | draft
    num_tokens: int = 5  # K: tokens proposed per step
    draft_model: str | None = None  # for `draft`: a model name or path, resolved by whoever loads it
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix that counts as a match
    max_running: int = 4  # speculate only while at most this many sequences run
    # Choose each step's K (up to num_tokens, 0 included) by measured yield (DraftLength); False: always K.
    adaptive: bool = False

    @classmethod
    def parse(cls, spec: str | None, num_tokens: int = 5, length: str = "fixed") -> SpeculativeConfig:
        """`off`, `ngram` or `draft:MODEL`, as the CLI and wafer.toml spell it; `length`: `fixed` (K
        every step) or `adaptive` (up to K, by measured yield)."""
        spec = (spec or "off").strip()
        if num_tokens < 1:
            raise ValueError("the number of speculative tokens must be at least 1")
        if length not in ("fixed", "adaptive"):
            raise ValueError(f"speculative length {length!r}: expected fixed or adaptive")
        adaptive = length == "adaptive"
        if spec in ("off", "ngram"):
            return cls(method=spec, num_tokens=num_tokens, adaptive=adaptive)
        if spec.startswith("draft:") and spec[len("draft:"):]:
            return cls(method="draft", num_tokens=num_tokens, draft_model=spec[len("draft:"):], adaptive=adaptive)
        raise ValueError(f"speculative method {spec!r}: expected off, ngram or draft:MODEL")

    @property
    def enabled(self) -> bool:
        return self.method != "off"
