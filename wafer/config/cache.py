"""The KV cache's settings."""

from __future__ import annotations

from dataclasses import dataclass

# auto: bf16 on the CPU's quantised paths, else the model's activation type (engine/kv_layout.py);
# int8 and fp8 (e4m3) keep a scale per position and head.
KV_CACHE_DTYPES = ("auto", "f32", "bf16", "int8", "fp8")


@dataclass
class CacheSettings:
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Bytes of KV the cache may hold; None: a quarter of the machine's memory, or less when every
    # running sequence fits at its whole context.
    kv_cache_memory: int | None = None
    prefix_caching: bool = True  # reuse the KV of earlier requests' shared prompt prefixes
