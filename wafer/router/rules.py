"""The rule set behind `auto` and `gpt-5.6`: which tier a request needs, and which rule said so.

Rules are tried in this order; the first that matches decides (the tier each sends to is
configurable under [routing.tiers]):

  effort_high / effort_low / effort_medium   `reasoning_effort` high, xhigh, max, ultra / none, minimal, low / medium
  hint          the last user message asks for effort ("think hard", ... see [routing] hints)
  long_prompt   the prompt has at least `long_prompt_tokens` tokens
  multi_step    the last user message lists `multi_step_min_steps` or more steps (numbered or bulleted
                lines, or "first ... then ... finally")
  tools         the request offers tools
  code          the conversation contains code (fences, or lines that look like a program)
  short_prompt  the prompt has fewer than `short_prompt_tokens` tokens
  default       everything else
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from wafer.router.config import RoutingConfig

_HIGH = {"high", "xhigh", "max", "ultra"}
_LOW = {"none", "minimal", "low"}
# Every pattern is linear in the text: the texts are the users' (megabytes allowed), and Python's re
# holds the GIL, so a pattern that backtracks over them stalls every stream. Hence no unbounded
# repetition that can restart at each position: `[ \t]*` not `\s*` after `^`, a word boundary before
# `\w`, and a bounded argument list.
_CODE = re.compile(
    r"```|^[ \t]*(def|class|import|from \S+ import|function|const|let|var|public|#include|SELECT|fn|package)\b"
    r"|\b\w{1,64}\([^)\n]{0,256}\)[ \t]*[{:][ \t]*$|;[ \t]*$",
    re.MULTILINE | re.IGNORECASE,
)
_STEP_LINE = re.compile(r"^[ \t]*(\d{1,4}[.)]|[-*•]|step \d{1,4})[ \t]+\S", re.MULTILINE | re.IGNORECASE)
_FIRST = re.compile(r"\bfirst\b", re.IGNORECASE)
_THEN = re.compile(r"\bthen\b", re.IGNORECASE)
_LAST = re.compile(r"\b(finally|after that|and then|lastly)\b", re.IGNORECASE)


_SAMPLE = 32 * 1024


def _sample(text: str) -> str:
    """What the pattern rules read of a long text: its start and its end, which is where steps and
    code show; cost stays bounded whatever the size of the body."""
    return text if len(text) <= 2 * _SAMPLE else text[:_SAMPLE] + "\n" + text[-_SAMPLE:]


def _in_sequence(text: str) -> bool:
    """"first ... then ... finally" in that order: each word searched once from where the one
    before it was found (the earliest match leaves the most room for the next)."""
    first = _FIRST.search(text)
    then = _THEN.search(text, first.end()) if first else None
    return bool(then and _LAST.search(text, then.end()))


@dataclass
class Route:
    tier: str
    rule: str


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                # Text parts only: other parts' keys are not validated, so their "text" may be anything.
                return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            return content or ""
    return ""


def choose(body: dict[str, Any], prompt_tokens: int, cfg: RoutingConfig) -> Route:
    def to(rule: str) -> Route:
        return Route(cfg.tiers[rule], rule)

    effort = body.get("reasoning_effort")
    if effort in _HIGH:
        return to("effort_high")
    if effort in _LOW:
        return to("effort_low")
    if effort == "medium":
        return to("effort_medium")
    messages = body.get("messages") or []
    text = last_user_text(messages) if messages else str(body.get("prompt", ""))
    lowered = text.lower()
    if any(h.lower() in lowered for h in cfg.hints):
        return to("hint")
    if prompt_tokens >= cfg.long_prompt_tokens:
        return to("long_prompt")
    if len(_STEP_LINE.findall(_sample(text))) >= cfg.multi_step_min_steps or _in_sequence(_sample(text)):
        return to("multi_step")
    if body.get("tools"):
        return to("tools")
    everything = "\n".join(str(m.get("content") or "") for m in messages) if messages else text
    if _CODE.search(_sample(everything)):
        return to("code")
    if prompt_tokens < cfg.short_prompt_tokens:
        return to("short_prompt")
    return to("default")
