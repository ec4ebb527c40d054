"""Speculative decoding's settings, as `wafer serve` and wafer.toml spell them, and the engine's own
limits on when and how far it looks up n-grams."""

from __future__ import annotations

from dataclasses import dataclass

# adaptive: each step proposes the number of tokens, up to K and none included, that measured
# steps show to decode fastest; fixed: always K.
SPECULATIVE_LENGTHS = ("adaptive", "fixed")


@dataclass
class SpeculationSettings:
    speculative: str = "off"  # off | ngram | suffix | draft:MODEL | auto, or several joined by commas
    num_speculative_tokens: int = 5  # K, the most tokens proposed a step
    speculative_length: str = "adaptive"  # one of SPECULATIVE_LENGTHS
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix that counts as a match
    speculate_max_running: int = 4  # speculate only while at most this many sequences run
    suffix_max_depth: int = 24  # the longest match suffix drafts look for (a suffix tree's depth)
    suffix_min_prob: float = 0.1  # a suffix draft ends where its estimated probability falls below this
    suffix_cache_tokens: int = 200_000  # earlier outputs kept for suffix drafts, all keys together
    suffix_tree: bool = False  # suffix drafts as trees of candidates, where verification takes them
