"""wafer's settings and their defaults, each written once: the engine's, the KV cache's,
speculation's, loading's, the server's and model-written programs' dataclasses, and the tiers' names and aliases as data
(default.toml). `wafer serve`'s flags, wafer.toml's keys, the server and the engine take their
defaults from here, and tests/config/test_defaults.py fails where a default is written elsewhere.

Every layer may import this package, so it imports nothing of wafer's."""

from wafer.config.cache import KV_CACHE_DTYPES, CacheSettings
from wafer.config.engine import EngineSettings
from wafer.config.load import DEVICES, LoadSettings
from wafer.config.sandbox import MAY_BE_ZERO, MIN_MEMORY_BYTES, SANDBOX_FLAGS, ProgramLimits, ProgramPoolSettings
from wafer.config.server import REASONING_BUDGETS, ServerSettings
from wafer.config.speculation import SPECULATIVE_LENGTHS, SpeculationSettings
from wafer.config.tiers import NO_TOOL_CALLS, NO_TOOL_RESULTS, ROUTER_NAMES, ROUTING_TIERS, TIER_ALIASES, TIERS

SETTINGS = (EngineSettings, CacheSettings, SpeculationSettings, LoadSettings, ServerSettings)

__all__ = ["DEVICES", "KV_CACHE_DTYPES", "MAY_BE_ZERO", "MIN_MEMORY_BYTES", "NO_TOOL_CALLS", "NO_TOOL_RESULTS",
           "REASONING_BUDGETS", "ROUTER_NAMES", "ROUTING_TIERS", "SANDBOX_FLAGS", "SETTINGS", "SPECULATIVE_LENGTHS",
           "TIERS", "TIER_ALIASES", "CacheSettings", "EngineSettings", "LoadSettings", "ProgramLimits",
           "ProgramPoolSettings", "ServerSettings",
           "SpeculationSettings"]
