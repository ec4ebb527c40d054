"""From the `model` a client asked for to the targets that may answer it, in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wafer.config import ROUTER_NAMES, TIER_ALIASES, TIERS
from wafer.router.config import ServeConfig
from wafer.router.rules import choose


class UnknownModel(LookupError):
    pass


@dataclass
class Decision:
    targets: list[str]  # model or upstream names: the first serves, the rest are fallbacks
    tier: str | None
    rule: str  # which rule chose: a routing rule name, or "tier", "alias", "model"


class Router:
    def __init__(self, config: ServeConfig, count_tokens: Callable[[dict[str, Any]], int]) -> None:
        self.config = config
        self.count_tokens = count_tokens

    @property
    def names(self) -> list[str]:
        """Every name a client may send, as /v1/models lists them."""
        c = self.config
        names = [*c.models, *c.upstreams, *TIERS, *ROUTER_NAMES, *TIER_ALIASES, *c.aliases]
        return list(dict.fromkeys(names))

    def resolve(self, name: str, body: dict[str, Any]) -> Decision:
        c = self.config
        if name in ROUTER_NAMES:
            route = choose(body, self.count_tokens(body), c.routing)
            return Decision(c.tiers[route.tier], route.tier, route.rule)
        if name in TIERS:
            return Decision(c.tiers[name], name, "tier")
        if name in TIER_ALIASES:
            tier = TIER_ALIASES[name]
            return Decision(c.tiers[tier], tier, "tier")
        if name in c.aliases:
            target = c.aliases[name]
            if target in TIERS:
                return Decision(c.tiers[target], target, "alias")
            return Decision([target], None, "alias")
        if name in c.models or name in c.upstreams:
            return Decision([name], None, "model")
        raise UnknownModel(name)
