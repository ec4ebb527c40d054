"""Speculative decoding's settings for an engine, parsed from the CLI's and wafer.toml's spelling;
their defaults are wafer.config's SpeculationSettings."""

from __future__ import annotations

from dataclasses import dataclass

from wafer.config import SPECULATIVE_LENGTHS, SpeculationSettings


# What `auto` turns on: the proposers that need no model.
AUTO = ("ngram", "suffix")


@dataclass
class SpeculativeConfig:
    method: str = SpeculationSettings.speculative  # off | ngram | suffix | draft | auto (several)
    # The proposers on, in the order given (one but for `auto`): the engine picks among them per
    # sequence and step.
    methods: tuple[str, ...] = ()
    num_tokens: int = SpeculationSettings.num_speculative_tokens  # K: tokens proposed per step
    draft_model: str | None = None  # for `draft`: a model name or path, resolved by whoever loads it
    ngram_max: int = SpeculationSettings.ngram_max
    ngram_min: int = SpeculationSettings.ngram_min
    max_running: int = SpeculationSettings.speculate_max_running
    suffix_max_depth: int = SpeculationSettings.suffix_max_depth
    suffix_min_prob: float = SpeculationSettings.suffix_min_prob
    suffix_cache_tokens: int = SpeculationSettings.suffix_cache_tokens
    suffix_tree: bool = SpeculationSettings.suffix_tree
    # Choose each step's K (up to num_tokens, 0 included) by measured yield (DraftLength); False: always K.
    adaptive: bool = SpeculationSettings.speculative_length == "adaptive"

    @classmethod
    def parse(cls, spec: str | None, num_tokens: int = SpeculationSettings.num_speculative_tokens,
              length: str = SpeculationSettings.speculative_length) -> SpeculativeConfig:
        """`off`, `ngram`, `suffix`, `draft:MODEL`, `auto` (n-gram and suffix), or several joined by
        commas (`auto,draft:terra`), as the CLI and wafer.toml spell it; `length`: `fixed` (K every
        step) or `adaptive` (up to K, by measured yield)."""
        spec = (spec or "off").strip()
        if num_tokens < 1:
            raise ValueError("the number of speculative tokens must be at least 1")
        if length not in SPECULATIVE_LENGTHS:
            raise ValueError(f"speculative length {length!r}: expected {' or '.join(SPECULATIVE_LENGTHS)}")
        adaptive = length == "adaptive"
        if spec == "off":
            return cls(method="off", num_tokens=num_tokens, adaptive=adaptive)
        methods: list[str] = []
        draft_model = None
        for part in (p.strip() for p in spec.split(",")):
            if part in ("ngram", "suffix", "auto"):
                names = AUTO if part == "auto" else (part,)
            elif part.startswith("draft:") and part[len("draft:"):] and draft_model is None:
                names, draft_model = ("draft",), part[len("draft:"):]
            else:
                raise ValueError(f"speculative method {spec!r}: expected off, ngram, suffix, draft:MODEL or auto, "
                                 "or several of them joined by commas")
            methods += [n for n in names if n not in methods]
        method = methods[0] if len(methods) == 1 else "auto"
        return cls(method=method, methods=tuple(methods), num_tokens=num_tokens, draft_model=draft_model,
                   adaptive=adaptive)

    def __post_init__(self) -> None:
        if not self.methods and self.method not in ("off", "auto"):
            self.methods = (self.method,)
        elif self.method == "auto" and not self.methods:
            self.methods = AUTO

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def draft_of(spec: str | None) -> str | None:
    """The draft model a spelling names (`draft:MODEL`, alone or among others), if any."""
    for part in (spec or "").split(","):
        if part.strip().startswith("draft:"):
            return part.strip()[len("draft:"):] or None
    return None


def without_draft(spec: str | None) -> str:
    """The spelling with its draft model left out: `off` where nothing else was on."""
    return ",".join(p.strip() for p in (spec or "").split(",") if p.strip() and not p.strip().startswith("draft:")) \
        or "off"
