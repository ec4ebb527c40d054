"""The completion searches that let a constrained reply finish within max_tokens share one budget per
engine step: a search beyond it waits for the next step and goes first there, but only where the
tokens left allow the unrestricted token sampled meanwhile."""

from __future__ import annotations

import json

import torch
from llguidance import LLMatcher

from wafer.engine.constraints import WINDOW, Constraints, mask_logits

# An object whose shortest completion from the start is long enough to need a search of many steps.
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(6)},
          "required": [f"field_{i}" for i in range(6)]}


def _grammar() -> str:
    return LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))


def test_a_first_search_runs_even_when_the_steps_budget_is_spent(smollm):
    constraints = Constraints(smollm.tokenizer)
    first, second = constraints.matcher(_grammar()), constraints.matcher(_grammar())
    constraints.new_step()
    plan = first.completion(tokens_left=500)
    assert plan, "the first search of a step always runs"
    assert json.loads(constraints.llt.decode_bytes(plan).decode()).keys() == SCHEMA["properties"].keys()
    assert constraints.step_fuel < 2_000
    constraints.step_fuel = 0  # this step's budget gone (as after several searches)
    # No earlier completion tells how much slack there is: it cannot wait.
    assert second.completion(tokens_left=500) == plan


def test_a_search_with_slack_waits_one_step_then_goes_first(smollm):
    constraints = Constraints(smollm.tokenizer)
    matchers = [constraints.matcher(_grammar()) for _ in range(3)]
    constraints.new_step()
    plans = [m.completion(tokens_left=500) for m in matchers]
    opening = plans[0][0]
    for m in matchers:
        assert m.consume_token(opening)  # "{" or its like: the completion is stale again
    n = len(plans[0])

    constraints.new_step()
    constraints.step_fuel = 0
    roomy, tight, unknown = matchers
    assert roomy.completion(tokens_left=n + 2 * WINDOW + 1) is None  # put off to the next step
    assert tight.completion(tokens_left=n + 2 * WINDOW)  # too little slack to wait
    assert unknown.completion() is not None  # no tokens_left given: nothing to wait on
    assert constraints.step_fuel < 0

    constraints.new_step()
    constraints.step_fuel = 0
    again = roomy.completion(tokens_left=n + 2 * WINDOW + 1)  # put off once: it goes, budget or not
    assert again and again == tight.completion(tokens_left=n)
    constraints.new_step()
    assert roomy.completion(tokens_left=500) == again and constraints.step_fuel == 2_000  # kept


def test_a_reply_with_no_slack_finishes_though_every_steps_budget_is_spent(smollm):
    """max_tokens equal to the shortest reply, the step's fuel gone on every step (many constrained
    sequences beside it), and random logits: the reply must still be the whole object in time."""
    constraints = Constraints(smollm.tokenizer)
    probe = constraints.matcher(_grammar())
    budget = len(probe.completion(tokens_left=500))
    vocab = smollm.tokenizer.vocab_size
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        matcher = constraints.matcher(_grammar())
        out: list[int] = []
        for step in range(budget):
            constraints.new_step()
            constraints.step_fuel = 0
            logits = torch.randn(vocab, generator=generator)
            mask_logits(logits, matcher, tokens_left=budget - step)
            token = int(torch.argmax(logits))
            assert matcher.consume_token(token)
            out.append(token)
        assert matcher.is_accepting(), f"seed {seed}: unfinished after {budget} tokens"
        reply = json.loads(constraints.llt.decode_bytes(out).decode())
        assert reply.keys() == SCHEMA["properties"].keys()


def test_a_primed_matcher_and_its_copies_start_with_their_completion(smollm):
    """The request's matcher searches once where the request is prepared; each sequence's copy then
    needs no search of its own in a step, and may wait at its next one."""
    constraints = Constraints(smollm.tokenizer)
    compiled = constraints.matcher(_grammar())
    compiled.prime()
    plan = compiled.completion()
    constraints.new_step()
    constraints.step_fuel = 0
    copy = compiled.deep_copy()
    assert copy.completion(tokens_left=len(plan)) == plan and constraints.step_fuel == 0  # no search
    assert copy.consume_token(plan[0])
    assert copy.completion(tokens_left=len(plan) + 2 * WINDOW + 1) is None  # a known length: it may wait


def test_after_an_empty_completion_the_next_search_does_not_wait(smollm):
    """A grammar that could end (a tool call not yet opened) says nothing of the length of what its
    next token opens: that search runs now."""
    constraints = Constraints(smollm.tokenizer)
    grammar = LLMatcher.grammar_from_lark('start: obj?\nobj: "{\\"note\\": \\"" /[a-z]+/ "\\", \\"n\\": " /[0-9]+/ "}"')
    matcher = constraints.matcher(grammar)
    constraints.new_step()
    assert matcher.completion(tokens_left=500) == []
    assert matcher.consume_token(constraints.llt.tokenize_str("{")[0])
    constraints.step_fuel = 0
    plan = matcher.completion(tokens_left=500)
    assert plan, "searched although the step's fuel was spent"


def test_generate_follows_a_grammar_outside_the_servers_inference_mode(smollm):
    """LLMEngine used directly (not under the server's torch.inference_mode) on the default compute
    path: the grammar's mask changes the step's logits in place, which must not fail the sequence."""
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    assert not torch.is_inference_mode_enabled()
    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512))
    params = SamplingParams(max_tokens=120, temperature=0.7, seed=3, grammar=_grammar())
    seq = engine.generate([smollm.tokenizer.encode("A JSON object:", add_special_tokens=False)], params)[0]
    assert seq.finish_reason == "stop", seq.finish_reason
    assert set(SCHEMA["required"]) <= set(json.loads(seq.text))


def test_a_steps_grammar_masks_are_timed_apart(smollm):
    """What a step spent on its grammars' masks is kept beside its forward pass (the slow-step log
    and the step observers name it): some for a step that masked, none for one that did not."""
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512))
    prompt = smollm.tokenizer.encode("A JSON object:", add_special_tokens=False)
    engine.add(prompt, SamplingParams(max_tokens=3, temperature=0, grammar=_grammar()))
    masked = []
    while engine.has_work:
        engine.step()
        masked.append(engine.stats.last_mask_seconds)
    assert masked and all(0 < s < engine.stats.last_forward_seconds + 10 for s in masked)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    assert engine.stats.last_mask_seconds == 0.0


def test_a_search_that_finds_nothing_waits_1_2_4_8_tokens_before_the_next(smollm):
    """A grammar whose completion cannot be found costs one search now and then, not one a token."""
    constraints = Constraints(smollm.tokenizer)
    matcher = constraints.matcher(LLMatcher.grammar_from_lark('start: /[a-z]+/ "."'))
    searched = []
    matcher._complete = lambda *_: searched.append(step) or None  # type: ignore[method-assign]  # finds nothing
    letter = constraints.llt.tokenize_str("a")[0]
    for step in range(16):
        constraints.new_step()
        assert matcher.completion(tokens_left=500) is None
        assert matcher.consume_token(letter)  # text outside JSON: each token makes the completion stale
    assert searched == [0, 1, 3, 7, 15]


def test_a_search_ends_when_its_time_is_spent(smollm, monkeypatch):
    """The search's CPU time is bounded besides its fuel: a grammar whose every step is slow
    (forced bytes that nest without end) cannot hold the engine's step for long."""
    import wafer.engine.constraints as constraints_module

    # With time to spare the search finds the completion (a machine busy with other jobs may spend
    # more than the engine's 25 ms on it: the control must not depend on that) ...
    monkeypatch.setattr(constraints_module, "_SEARCH_SECONDS", 10.0)
    assert Constraints(smollm.tokenizer).matcher(_grammar()).completion(tokens_left=500)
    # ... and with its time spent before it starts, it gives up whatever its fuel.
    monkeypatch.setattr(constraints_module, "_SEARCH_SECONDS", -1.0)
    assert Constraints(smollm.tokenizer).matcher(_grammar()).completion(tokens_left=500) is None


def _engine_with_neighbour(smollm, schema, **config):
    """A constrained sequence (its schema's grammar) beside a plain one, stepped to the end: the
    outputs each produced."""
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    engine = LLMEngine(smollm, EngineConfig(max_running=2, max_model_len=512, **config))
    prompt = smollm.tokenizer.encode("A JSON object:", add_special_tokens=False)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    constrained = engine.add(prompt, SamplingParams(max_tokens=40, temperature=0, grammar=grammar))
    plain = engine.add(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outputs: dict[int, list] = {constrained.seq_id: [], plain.seq_id: []}
    while engine.has_work:
        for out in engine.step():
            outputs[out.seq_id].append(out)
    return outputs[constrained.seq_id], outputs[plain.seq_id]


def test_a_grammar_llguidance_stops_at_its_limits_ends_its_sequence_alone_with_an_error(smollm):
    """A schema no up-front check sees as endless (a recursive key it takes at least one of): once
    llguidance's limits on a step's work stop the matcher, the sequence fails with GrammarTooCostly
    rather than end as if its JSON were complete; its neighbour goes on to its end."""
    endless = {"type": "object", "patternProperties": {"^a$": {"$ref": "#"}}, "minProperties": 1,
               "additionalProperties": False,  # compact, as the server asks for JSON
               "x-guidance": {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}}
    constrained, plain = _engine_with_neighbour(smollm, endless)
    assert constrained[-1].finish_reason == "error" and constrained[-1].error.startswith("GrammarTooCostly")
    assert "llguidance stopped it" in constrained[-1].error
    assert plain[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in plain) == 12


def test_a_request_past_its_grammar_budget_ends_alone_with_an_error(smollm):
    """Whatever made its grammar work slow, a request past grammar_seconds_per_token for each of its
    tokens ends there, alone (the default budget serves the grammars of the tests above)."""
    constrained, plain = _engine_with_neighbour(smollm, SCHEMA, grammar_seconds_per_token=1e-9)
    assert constrained[-1].finish_reason == "error" and constrained[-1].error.startswith("GrammarTooCostly")
    assert "grammar_ms_per_token" in constrained[-1].error
    assert plain[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in plain) == 12
