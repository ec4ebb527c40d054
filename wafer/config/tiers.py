"""The tiers, their aliases and the routing rules' tiers: data, read from default.toml beside this
file, so that renaming a tier or adding an alias changes no code."""

from __future__ import annotations

import tomllib
from pathlib import Path

_DEFAULT = tomllib.loads((Path(__file__).parent / "default.toml").read_text())

TIERS: tuple[str, ...] = tuple(_DEFAULT["tiers"])
ROUTER_NAMES: tuple[str, ...] = tuple(_DEFAULT["router_names"])
TIER_ALIASES: dict[str, str] = dict(_DEFAULT["aliases"])
ROUTING_TIERS: dict[str, str] = dict(_DEFAULT["routing"]["tiers"])
NO_TOOL_CALLS: tuple[str, ...] = tuple(_DEFAULT["routing"]["no_tool_calls"])
NO_TOOL_RESULTS: tuple[str, ...] = tuple(_DEFAULT["routing"]["no_tool_results"])
