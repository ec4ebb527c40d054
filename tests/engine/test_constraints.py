"""The completion searches that let a constrained reply finish within max_tokens share one budget per
engine step: a search beyond it waits for the next step and goes first there."""

from __future__ import annotations

import json

from llguidance import LLMatcher

from wafer.engine.constraints import Constraints

# An object whose shortest completion from the start is long enough to need a search of many steps.
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(6)},
          "required": [f"field_{i}" for i in range(6)]}


def test_a_search_past_the_steps_budget_waits_one_step_then_goes_first(smollm):
    constraints = Constraints(smollm.tokenizer)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    first, second, third = (constraints.matcher(grammar) for _ in range(3))

    constraints.new_step()
    plan = first.completion()
    assert plan, "the first search of a step always runs"
    text = constraints.llt.decode_bytes(plan).decode()
    assert json.loads(text).keys() == SCHEMA["properties"].keys()  # it finishes the object
    spent = 2_000 - constraints.step_fuel
    assert spent > 0

    constraints.step_fuel = 0  # this step's budget gone (as after several searches)
    assert second.completion() is None and third.completion() is None  # both put off

    constraints.new_step()
    constraints.step_fuel = 0
    assert second.completion() == plan and third.completion() == plan  # put off once: they go, budget or not
    assert constraints.step_fuel < 0

    constraints.new_step()
    assert constraints.step_fuel == 2_000
    assert second.completion() == plan  # kept: no new search
    assert constraints.step_fuel == 2_000
