"""reasoning_effort on /v1/chat/completions: a budget of reasoning tokens per effort level, enforced
on a model that thinks natively (a tiny random model with a Qwen3-style thinking template, whose
thought never ends by itself, so only the budget can end it) and spent on an explicit reasoning
turn by one that does not (the bundled SmolLM2)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import MODEL, serve_app
from tests.tiny import THINKING_TEMPLATE, make_hf_model, with_chat_template
from wafer.router.config import REASONING_BUDGETS, ConfigError, load_config
from wafer.server import reasoning
from wafer.server.app import create_app
from wafer.server.main import load_models

TINY = "tiny-think"
# Small budgets, so that a test runs every level in seconds; read from wafer.toml like any other.
TABLE = {"minimal": 8, "low": 16, "medium": 24, "high": 32, "xhigh": 40, "max": 48}
MESSAGES = [{"role": "user", "content": "What is seven times six?"}]


def _toml(path, model_dir, table: dict[str, int]) -> str:
    rows = "\n".join(f"{k} = {json.dumps(v)}" for k, v in table.items())
    path.write_text(f'[models.{TINY}]\npath = "{model_dir}"\nprice = {{input = 0.1, output = 0.4}}\n\n'
                    f"[reasoning]\n{rows}\n")
    return path


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A wafer server, loaded from a wafer.toml as `wafer serve --config` loads it, over a tiny
    random model whose chat template has a thinking switch."""
    base = tmp_path_factory.mktemp("think")
    model_dir = with_chat_template(make_hf_model(base / "hf", "llama", seed=3), base / "model", THINKING_TEMPLATE)
    cfg = load_config(_toml(base / "wafer.toml", model_dir, TABLE))
    [served] = load_models(cfg, quiet=True)
    s = serve_app(create_app(served), served)
    yield s
    s.stop()


@pytest.fixture()
def tclient(thinking):
    return OpenAI(base_url=thinking.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def forced_close_tokens(hf_tok) -> int:
    """Tokens of the close that ends a thought cut by its budget, by transformers' own tokenizer."""
    return len(hf_tok.encode(reasoning.FORCED_CLOSE, add_special_tokens=False))


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def scrape(base_url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def reasoning_counter(base_url: str, model: str, effort: str) -> float:
    return scrape(base_url).get("wafer:reasoning_tokens_total" + json.dumps(
        {"effort": effort, "model_name": model}, sort_keys=True), 0.0)


def stream(client: OpenAI, **kw) -> tuple[str, str, list[str], object, str]:
    """Reasoning, content, the order of delta kinds, usage and finish_reason of a streamed reply."""
    thought = content = ""
    kinds: list[str] = []
    usage = finish = None
    for ch in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            r = (c.delta.model_extra or {}).get("reasoning_content")
            if r:
                thought += r
                kinds.append("reasoning")
            if c.delta.content:
                content += c.delta.content
                kinds.append("content")
            finish = c.finish_reason or finish
    return thought, content, kinds, usage, finish


# --- the table and the detection ---------------------------------------------------------------
def test_budget_is_the_table_capped_so_the_answer_keeps_tokens():
    assert [reasoning.budget(e, REASONING_BUDGETS, 100_000) for e in REASONING_BUDGETS] == \
        [0, 64, 256, 1024, 4096, 8192, 16384]
    assert reasoning.budget("ultra", REASONING_BUDGETS, 100_000) == 16384  # as max
    # reasoning and answer share the limit: the answer keeps 256 tokens, or a quarter of a small limit
    assert reasoning.budget("max", REASONING_BUDGETS, 2000) == 2000 - 256
    assert reasoning.budget("medium", REASONING_BUDGETS, 400) == 300
    assert reasoning.budget("low", REASONING_BUDGETS, 1) == 0


def test_native_thinking_is_read_from_the_template(thinking):
    from wafer.models import catalog
    from wafer.models.loader import load_tokenizer

    assert reasoning.thinks_natively(thinking.served.chat_template.source)
    installed = [p for p in map(catalog.installed_path, catalog.CATALOG) if p is not None]
    assert installed
    for path in installed:  # SmolLM2 and Qwen2.5-Coder have no thinking switch
        assert not reasoning.thinks_natively(load_tokenizer(str(path)).chat_template)


def test_reasoning_table_in_wafer_toml(tmp_path):
    cfg = load_config(_toml(tmp_path / "a.toml", tmp_path, {"low": 100, "max": 900}))
    assert cfg.reasoning == {**REASONING_BUDGETS, "low": 100, "max": 900}
    assert cfg.models[TINY].price == {"input": 0.1, "output": 0.4}  # the price table still parses beside it
    for bad in ({"huge": 5}, {"low": -1}, {"low": 1.5}, {"low": True}, {"none": 10}):
        with pytest.raises(ConfigError, match=r"\[reasoning\]"):
            load_config(_toml(tmp_path / "b.toml", tmp_path, bad))


# --- a model that thinks natively: the budget ends the thought ----------------------------------
@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high", "xhigh", "max", "ultra"])
def test_budget_enforced_at_each_effort(thinking, tclient, hf_tok, effort):
    budget = TABLE[reasoning.level(effort)]
    engine = thinking.engine
    before_generated = engine.stats.generated_tokens
    before_counter = reasoning_counter(thinking.base_url, TINY, effort)
    # ignore_eos: the random model's thought could otherwise end only by an unlikely end token, and
    # the answer runs to max_tokens, which must hold reasoning and answer together.
    r = tclient.chat.completions.create(model=TINY, messages=MESSAGES, reasoning_effort=effort, max_tokens=80,
                                        seed=7, extra_body={"ignore_eos": True})
    msg, usage = r.choices[0].message, r.usage
    thought = reasoning_of(msg)
    assert usage.completion_tokens_details.reasoning_tokens == budget
    assert usage.completion_tokens == 80 and r.choices[0].finish_reason == "length"
    assert engine.stats.generated_tokens - before_generated == usage.completion_tokens
    assert thought and msg.content, (thought, msg.content)
    assert "<think>" not in msg.content and "</think>" not in msg.content and thought not in msg.content
    assert "</think>" not in thought
    # prompt tokens: the prompt as transformers renders it with thinking on, the <think> wafer opens
    # and the </think> it forced, as tokens read
    rendered = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                          chat_template=THINKING_TEMPLATE, enable_thinking=True)
    opened = len(hf_tok.encode(rendered + "<think>\n", add_special_tokens=False))
    assert usage.prompt_tokens == opened + forced_close_tokens(hf_tok)
    assert reasoning_counter(thinking.base_url, TINY, effort) - before_counter == budget


def test_thought_ends_by_itself_or_by_budget_without_ignore_eos(tclient):
    for seed in range(3):
        r = tclient.chat.completions.create(model=TINY, messages=MESSAGES, reasoning_effort="medium", max_tokens=64,
                                            seed=seed)
        used = r.usage.completion_tokens_details.reasoning_tokens
        assert 0 < used <= TABLE["medium"]
        assert r.usage.completion_tokens <= 64 and r.usage.completion_tokens > used
        assert reasoning_of(r.choices[0].message)


def test_budget_capped_by_max_tokens(tclient, thinking):
    served = thinking.served
    table = dict(served.reasoning)
    served.reasoning = dict(REASONING_BUDGETS)  # max: 16384 tokens, far beyond the limit
    try:
        r = tclient.chat.completions.create(model=TINY, messages=MESSAGES, reasoning_effort="max", max_tokens=120,
                                            seed=1, extra_body={"ignore_eos": True})
    finally:
        served.reasoning = table
    assert r.usage.completion_tokens_details.reasoning_tokens == 120 - 30  # the answer keeps a quarter
    assert r.usage.completion_tokens == 120 and r.choices[0].message.content


def test_none_switches_thinking_off_in_the_template(tclient, hf_tok):
    r = tclient.chat.completions.create(model=TINY, messages=MESSAGES, reasoning_effort="none", max_tokens=12,
                                        seed=1)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    off = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                     chat_template=THINKING_TEMPLATE, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert r.usage.prompt_tokens == len(hf_tok.encode(off, add_special_tokens=False))


def test_without_reasoning_effort_nothing_changes(tclient, hf_tok):
    r = tclient.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=12, seed=1)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    plain = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                       chat_template=THINKING_TEMPLATE)
    assert r.usage.prompt_tokens == len(hf_tok.encode(plain, add_special_tokens=False))


@pytest.mark.parametrize("effort", ["minimal", "high"])
def test_streamed_as_not(tclient, effort):
    kw = dict(model=TINY, messages=MESSAGES, reasoning_effort=effort, max_tokens=80, seed=11,
              extra_body={"ignore_eos": True})
    whole = tclient.chat.completions.create(**kw)
    thought, content, kinds, usage, finish = stream(tclient, **kw)
    assert usage.completion_tokens_details.reasoning_tokens == TABLE[effort]
    assert usage.completion_tokens == 80 and finish == "length"
    # all the reasoning comes first, and nothing of it in the content
    assert kinds.index("content") == kinds.count("reasoning") and kinds.count("reasoning") > 0
    assert thought == reasoning_of(whole.choices[0].message)
    assert content == whole.choices[0].message.content
    assert usage.model_dump() == whole.usage.model_dump()


def test_answer_keeps_its_grammar_reasoning_free(tclient):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    kw = dict(model=TINY, messages=MESSAGES, reasoning_effort="low", max_tokens=60, seed=5, response_format=fmt)
    r = tclient.chat.completions.create(**kw)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    thought = reasoning_of(r.choices[0].message)
    assert r.usage.completion_tokens_details.reasoning_tokens > 0 and thought
    with pytest.raises(ValueError):
        json.loads(thought)  # the random model's reasoning was not held to the schema
    _, content, _, usage, _ = stream(tclient, **kw)
    jsonschema.validate(json.loads(content), schema)


def test_n_above_one_is_refused(tclient):
    with pytest.raises(openai.BadRequestError) as e:
        tclient.chat.completions.create(model=TINY, messages=MESSAGES, reasoning_effort="low", n=2, max_tokens=8)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    r = httpx.post(tclient.base_url.join("chat/completions").__str__(),
                   json={"model": TINY, "messages": MESSAGES, "reasoning_effort": "lots"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


# --- a model that does not think natively: an explicit reasoning turn ---------------------------
QUESTION = [{"role": "user", "content": "A farmer has 3 fields with 12 cows in each. How many cows are there?"}]


def test_reasoning_turn_on_smollm(server, client):
    engine = server.engine
    before = engine.stats.generated_tokens
    counter = reasoning_counter(server.base_url, MODEL, "low")
    # Greedy: a 135M model sampled may copy its reasoning into its answer, which is the model's doing,
    # not the server's; greedy, it answers apart from it, the same on every sampler.
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="low", max_tokens=400,
                                       temperature=0)
    msg, usage = r.choices[0].message, r.usage
    thought = reasoning_of(msg)
    used = usage.completion_tokens_details.reasoning_tokens
    assert thought and thought.strip() and 0 < used <= REASONING_BUDGETS["low"]
    assert msg.content and msg.content.strip() and not msg.content.startswith(thought.strip())
    assert usage.completion_tokens > used
    assert engine.stats.generated_tokens - before == usage.completion_tokens
    assert reasoning_counter(server.base_url, MODEL, "low") - counter == used
    none = client.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="none", max_tokens=64,
                                          seed=1)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=64, seed=1)
    assert "reasoning_content" not in (none.choices[0].message.model_extra or {})
    assert none.usage.completion_tokens_details.reasoning_tokens == 0
    # no reasoning turn: the very request that no reasoning_effort makes
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_reasoning_turn_streamed_on_smollm(client):
    thought, content, kinds, usage, finish = stream(client, model=MODEL, messages=QUESTION, reasoning_effort="minimal",
                                                    max_tokens=200, seed=2)
    used = usage.completion_tokens_details.reasoning_tokens
    assert thought.strip() and content.strip() and 0 < used <= REASONING_BUDGETS["minimal"]
    assert kinds.index("content") == kinds.count("reasoning")
    assert finish in ("stop", "length")


def test_reasoning_turn_with_a_tool(client):
    tool = {"type": "function", "function": {"name": "count", "description": "Multiply two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}}
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[tool], tool_choice="required",
                                       parallel_tool_calls=False, reasoning_effort="minimal", max_tokens=160, seed=3)
    [call] = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "count" and set(args) == {"a", "b"}
    assert r.choices[0].finish_reason == "tool_calls" and reasoning_of(r.choices[0].message)


def test_disconnect_during_reasoning_frees_the_engine(thinking):
    served, engine = thinking.served, thinking.engine
    table = dict(served.reasoning)
    served.reasoning = {**TABLE, "max": 800}  # seconds of reasoning, then an answer, were the client to stay
    body = {"model": TINY, "messages": MESSAGES, "reasoning_effort": "max", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", thinking.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if "reasoning_content" in line:
                    break  # the reasoning turn is running: leave
        left_at = engine.stats.generated_tokens
        thinking.wait_idle(timeout=5)  # neither the reasoning turn goes on nor an answer starts
    finally:
        served.reasoning = table
    assert engine.stats.generated_tokens - left_at < 100
    assert served.engine.num_running == 0
