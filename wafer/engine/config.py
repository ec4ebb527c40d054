"""An engine's settings; their defaults are wafer.config's."""

from __future__ import annotations

from dataclasses import dataclass, field

from wafer.config import CacheSettings, EngineSettings
from wafer.engine.speculative.config import SpeculativeConfig


@dataclass
class EngineConfig:
    max_running: int = EngineSettings.max_running
    max_model_len: int | None = None  # default: the model's context length
    # Bytes of KV the cache may hold (default: default_kv_budget(), or less when every running
    # sequence fits at max_model_len). The pool takes memory only as its blocks are first written.
    kv_cache_memory: int | None = CacheSettings.kv_cache_memory
    kv_cache_dtype: str = CacheSettings.kv_cache_dtype  # see kv_layout.kv_dtype()
    max_batched_tokens: int = EngineSettings.max_batched_tokens  # per step: decode tokens plus prefill chunks
    prefix_caching: bool = CacheSettings.prefix_caching
    # Seconds of prompt work a step may take (None: no limit). The server sets it so that one
    # request's long prompt delays the others' tokens, and its own loop, by a bounded time.
    prefill_step_seconds: float | None = None
    # CPU seconds of grammar work (masks and completion searches) a constrained request may take per
    # token it generates (None: no limit); past it the request ends alone with GrammarTooCostly.
    grammar_seconds_per_token: float | None = EngineSettings.grammar_ms_per_token / 1000
    seed: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Stages the model's layers run in (the pipeline package): 1 is this process alone.
    pipeline_parallel: int = EngineSettings.pipeline_parallel
    # Seconds a step may take through the stages before the pipeline counts as broken.
    pipeline_timeout: float = 120.0
    # Where rank 0's store listens for the stages; spawn: this process starts them (else torchrun).
    pipeline_host: str = "127.0.0.1"
    pipeline_port: int | None = None
    pipeline_spawn: bool = True
