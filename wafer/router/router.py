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
            return self._tier(route.tier, route.rule, body)
        if name in TIERS:
            return self._tier(name, "tier", body)
        if name in TIER_ALIASES:
            return self._tier(TIER_ALIASES[name], "tier", body)
        if name in c.aliases:
            target = c.aliases[name]
            if target in TIERS:
                return self._tier(target, "alias", body)
            return Decision([target], None, "alias")
        if name in c.models or name in c.upstreams:
            return Decision([name], None, "model")
        raise UnknownModel(name)

    def _tier(self, tier: str, rule: str, body: dict[str, Any]) -> Decision:
        """The tier's targets; but a request that needs a tool call the tier's model does not make on
        its own (tools offered, the choice left to the model) goes to the `tool_calls` rule's tier,
        and one that needs an answer from a tool's result, which the tier's model does not give (it
        calls the tool again), to the `tool_results` rule's tier; the second is asked of the first's
        tier too."""
        r = self.config.routing
        if tier in r.no_tool_calls and wants_tool_calls(body) and r.tiers["tool_calls"] != tier:
            tier, rule = r.tiers["tool_calls"], "tool_calls"
        if tier in r.no_tool_results and wants_tool_answer(body) and r.tiers["tool_results"] != tier:
            tier, rule = r.tiers["tool_results"], "tool_results"
        return Decision(self.config.tiers[tier], tier, rule)


def wants_tool_calls(body: dict[str, Any]) -> bool:
    """Tools offered and `tool_choice` auto (or left out, which is auto): the model must decide to
    call. `required` or a named function is forced by the grammar, which any model follows."""
    return bool(body.get("tools")) and body.get("tool_choice", "auto") in ("auto", None)


def wants_tool_answer(body: dict[str, Any]) -> bool:
    """The conversation ends with a tool's result and the reply is left to the model (`tool_choice`
    auto, none or left out): it is due to answer from that result. `required` or a named function
    forces another call, which any model makes."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    return isinstance(last, dict) and last.get("role") == "tool" \
        and body.get("tool_choice", "auto") in ("auto", "none", None)
