"""The routing rule set: a table of requests whose tier is known."""

from __future__ import annotations

import pytest

from wafer.router.config import RoutingConfig
from wafer.router.rules import choose

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CASES = [
    # (body, prompt tokens, expected tier, expected rule)
    ({"messages": user("hi"), "reasoning_effort": "high"}, 5, "sol", "effort_high"),
    ({"messages": user("hi"), "reasoning_effort": "ultra"}, 5, "sol", "effort_high"),
    ({"messages": user("write an essay"), "reasoning_effort": "minimal"}, 5, "luna", "effort_low"),
    ({"messages": user("hi"), "reasoning_effort": "medium"}, 5, "terra", "effort_medium"),
    ({"messages": user("Think hard: is 1001 prime?")}, 12, "sol", "hint"),
    ({"messages": user("Please THINK CAREFULLY about this riddle")}, 12, "sol", "hint"),
    ({"messages": user("Summarise this. " + "word " * 3000)}, 3000, "sol", "long_prompt"),
    ({"messages": user("Plan my trip:\n1. book flights\n2. find a hotel\n3. plan the museums")}, 30, "sol",
     "multi_step"),
    ({"messages": user("First download the data, then clean it, and finally plot it.")}, 20, "sol", "multi_step"),
    ({"messages": user("What's the weather in Paris?"), "tools": TOOLS}, 10, "terra", "tools"),
    ({"messages": user("Why does this fail?\n```python\nprint(1/0)\n```")}, 20, "terra", "code"),
    ({"messages": user("def add(a, b):\n    return a - b\nfix it")}, 20, "terra", "code"),
    ({"messages": user("Hi!")}, 3, "luna", "short_prompt"),
    ({"messages": user("What is the capital of France?")}, 8, "luna", "short_prompt"),
    ({"messages": user("Tell me about the history of Rome. " * 40)}, 400, "terra", "default"),
    ({"prompt": "Once upon a time"}, 5, "luna", "short_prompt"),
    # Order matters: an explicit effort beats a hint, a hint beats code.
    ({"messages": user("think hard"), "reasoning_effort": "low"}, 3, "luna", "effort_low"),
    ({"messages": user("think hard about this code:\n```js\nx = 1;\n```")}, 20, "sol", "hint"),
]


@pytest.mark.parametrize("body,tokens,tier,rule", CASES)
def test_route_table(body, tokens, tier, rule):
    route = choose(body, tokens, RoutingConfig())
    assert (route.tier, route.rule) == (tier, rule)


def test_rules_are_configurable():
    cfg = RoutingConfig(short_prompt_tokens=2, hints=["pretty please"])
    cfg.tiers = {**cfg.tiers, "code": "sol"}
    assert choose({"messages": user("Hi!")}, 3, cfg).rule == "default"
    assert choose({"messages": user("pretty please")}, 3, cfg).rule == "hint"
    assert choose({"messages": user("think hard")}, 30, cfg).rule == "default"
    assert choose({"messages": user("```x```")}, 30, cfg).tier == "sol"


@pytest.mark.parametrize("text", ["first then " * 3000, "a" * 400_000, "a(" * 200_000, "\n" * 2_000_000,
                                  ("x( " + "b " * 120) * 5000, "1. do\n" * 200_000],
                         ids=["first-then", "one-word", "open-parens", "newlines", "calls", "steps"])
def test_rules_cost_stays_linear_on_pathological_text(text):
    """Python's re holds the GIL, so a pattern that backtracks over a user's text freezes every stream
    (the old patterns took seconds on 80 KB and hours on these). Each of these takes milliseconds now;
    the bound is two orders of magnitude above that, and far below what any quadratic pattern needs."""
    import time

    for body in ({"messages": user(text)},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "text": text}]}]}):
        start = time.perf_counter()
        choose(body, 10, RoutingConfig())
        assert time.perf_counter() - start < 2.0


def test_sequence_words_in_order():
    from wafer.router.rules import _in_sequence

    assert _in_sequence("First open it, then read it, and finally close it")
    assert not _in_sequence("then first, finally")  # out of order
    assert not _in_sequence("first, finally then")
    assert not _in_sequence("firstly thence finally")  # whole words only


@pytest.mark.parametrize("name,body,tier,rule", [
    ("luna", {"messages": user("Where is parcel ZX-4411?"), "tools": TOOLS}, "terra", "tool_calls"),
    ("luna", {"messages": user("Where?"), "tools": TOOLS, "tool_choice": "auto"}, "terra", "tool_calls"),
    ("gpt-5.6-luna", {"messages": user("Where?"), "tools": TOOLS}, "terra", "tool_calls"),
    ("auto", {"messages": user("Where?"), "tools": TOOLS, "reasoning_effort": "low"}, "terra", "tool_calls"),
    # The grammar forces these, which any model follows; no tools, nothing to call.
    ("luna", {"messages": user("Where?"), "tools": TOOLS, "tool_choice": "required"}, "luna", "tier"),
    ("luna", {"messages": user("Where?"), "tools": TOOLS, "tool_choice": "none"}, "luna", "tier"),
    ("luna", {"messages": user("Where?")}, "luna", "tier"),
    ("terra", {"messages": user("Where?"), "tools": TOOLS}, "terra", "tier"),
])
def test_a_tier_that_does_not_call_tools_sends_tool_requests_on(name, body, tier, rule):
    """luna's model answers in prose or code where a tool is due: a request for it that leaves the
    call to the model goes to the `tool_calls` rule's tier (configurable, as the tiers that do not
    call tools are)."""
    from wafer.router.config import ServeConfig
    from wafer.router.router import Router

    cfg = ServeConfig(models={}, upstreams={}, tiers={"sol": ["S"], "terra": ["T"], "luna": ["L"]}, aliases={},
                      routing=RoutingConfig())
    d = Router(cfg, lambda body: 10).resolve(name, body)
    assert (d.tier, d.rule, d.targets) == (tier, rule, cfg.tiers[tier])
    cfg.routing.tiers = {**cfg.routing.tiers, "tool_calls": "sol"}
    if rule == "tool_calls":
        assert Router(cfg, lambda body: 10).resolve(name, body).targets == ["S"]
    cfg.routing.no_tool_calls = []
    assert Router(cfg, lambda body: 10).resolve(name, body).rule != "tool_calls"


CALLED = [*user("Where is parcel ZX-4411?"),
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"code": "ZX-4411"}'}}]}]
RESULT = [*CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "In Leeds."}]


@pytest.mark.parametrize("name,body,tier,rule", [
    ("terra", {"messages": RESULT, "tools": TOOLS}, "sol", "tool_results"),
    ("gpt-5.6-terra", {"messages": RESULT, "tools": TOOLS, "tool_choice": "auto"}, "sol", "tool_results"),
    ("terra", {"messages": RESULT, "tools": TOOLS, "tool_choice": "none"}, "sol", "tool_results"),
    ("terra", {"messages": RESULT}, "sol", "tool_results"),
    # luna's request goes to terra for the call, and on to sol for the answer.
    ("luna", {"messages": RESULT, "tools": TOOLS}, "sol", "tool_results"),
    # A call the grammar forces, which terra makes; nothing to answer from yet; a later user turn.
    ("terra", {"messages": RESULT, "tools": TOOLS, "tool_choice": "required"}, "terra", "tier"),
    ("terra", {"messages": RESULT, "tools": TOOLS,
               "tool_choice": {"type": "function", "function": {"name": "f"}}}, "terra", "tier"),
    ("terra", {"messages": user("Where?"), "tools": TOOLS}, "terra", "tier"),
    ("terra", {"messages": [*CALLED], "tools": TOOLS}, "terra", "tier"),
    ("terra", {"messages": [*RESULT, *user("And parcel ZX-4412?")], "tools": TOOLS}, "terra", "tier"),
    ("sol", {"messages": RESULT, "tools": TOOLS}, "sol", "tier"),
])
def test_a_tier_that_does_not_answer_from_tool_results_sends_them_on(name, body, tier, rule):
    """terra's model calls the tool again after its result instead of answering (in transformers and
    llama.cpp too, from the same prompt): a request for it that ends with a tool result, the reply
    left to the model, goes to the `tool_results` rule's tier (configurable, as the tiers are)."""
    from wafer.router.config import ServeConfig
    from wafer.router.router import Router

    cfg = ServeConfig(models={}, upstreams={}, tiers={"sol": ["S"], "terra": ["T"], "luna": ["L"]}, aliases={},
                      routing=RoutingConfig())
    d = Router(cfg, lambda body: 10).resolve(name, body)
    assert (d.tier, d.rule, d.targets) == (tier, rule, cfg.tiers[tier])
    cfg.routing.no_tool_results = []
    assert Router(cfg, lambda body: 10).resolve(name, body).rule != "tool_results"
