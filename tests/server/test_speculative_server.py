"""Speculative decoding through the server (n-gram and suffix drafts, `auto`): the SDK sees the same
greedy text, streamed or not, /metrics carries vLLM's speculative counters and wafer's by proposer
and per step, and the dashboard's data the same."""

from __future__ import annotations

import inspect
import json
import textwrap

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.test_metrics import scrape
from tests.serving import MODEL, start_server
from wafer.engine.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def spec_server(smollm):
    s = start_server(smollm, max_running=4, engine_kw={"speculative": SpeculativeConfig.parse("auto", 6, "fixed")})
    yield s
    s.stop()


def test_same_text_as_plain_server_and_counters(spec_server, server):
    src = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))
    kw = dict(model=MODEL, temperature=0, max_tokens=80,
              messages=[{"role": "user", "content": f"Copy this code exactly:\n```python\n{src}\n```"}])
    plain = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).chat.completions.create(**kw)
    client = OpenAI(base_url=spec_server.base_url + "/v1", api_key="x", max_retries=0)
    fast = client.chat.completions.create(**kw)
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    streamed = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

    m = scrape(spec_server)
    st = spec_server.engine.stats.spec
    key = "{model_name=" + MODEL + "}"
    assert m["wafer:spec_decode_num_drafts_total" + key] == st.drafts > 0
    assert m["wafer:spec_decode_num_accepted_tokens_total" + key] == st.accepted_tokens > 0
    assert m["wafer:spec_decode_num_draft_tokens_total" + key] == st.draft_tokens
    assert m["wafer:spec_decode_mean_acceptance_length" + key] == pytest.approx(1 + st.accepted_tokens / st.drafts)
    assert m["wafer:spec_decode_num_accepted_tokens_per_pos_total{model_name=" + MODEL + ",position=0}"] > 0


def test_metrics_count_drafts_by_proposer_and_tokens_kept_per_step(spec_server):
    client = OpenAI(base_url=spec_server.base_url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, temperature=0, max_tokens=40,
              messages=[{"role": "user", "content": "List the days of the week, then list them again in reverse."}])
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)  # drafted from the first's output too (suffix)
    assert again.choices[0].message.content == first.choices[0].message.content

    m = scrape(spec_server)
    st = spec_server.engine.stats.spec
    one = "{model_name=" + MODEL + "}"

    def by(metric: str, method: str) -> float:
        return m.get(f"wafer:spec_decode_method_{metric}_total{{method={method},model_name={MODEL}}}", 0.0)

    assert by("num_drafts", "suffix") > 0 and by("num_drafts", "suffix") + by("num_drafts", "ngram") == st.drafts
    for method in ("ngram", "suffix"):
        kept = st.by_method[method].accepted_tokens if method in st.by_method else 0
        assert by("num_accepted_tokens", method) == kept
    assert m["wafer:spec_decode_num_steps_total" + one] == st.decode_steps >= st.drafts
    # The histogram of tokens kept per verifying step: cumulative buckets, its count the drafts, its sum the tokens.
    assert m["wafer:spec_decode_accepted_tokens_per_step_count" + one] == st.drafts
    assert m["wafer:spec_decode_accepted_tokens_per_step_sum" + one] == st.accepted_tokens
    buckets = {k: v for k, v in m.items() if k.startswith("wafer:spec_decode_accepted_tokens_per_step_bucket")}
    assert buckets[f"wafer:spec_decode_accepted_tokens_per_step_bucket{{le=0,model_name={MODEL}}}"] == \
        st.accepted_hist[0]
    assert buckets[f"wafer:spec_decode_accepted_tokens_per_step_bucket{{le=+Inf,model_name={MODEL}}}"] == st.drafts
    data = httpx.get(spec_server.base_url + "/dashboard/data").json()["speculation"]
    assert data["drafts"] == st.drafts and data["steps"] == st.decode_steps
    assert data["methods"]["suffix"]["accepted_tokens"] == st.by_method["suffix"].accepted_tokens > 0
    page = httpx.get(spec_server.base_url + "/dashboard").text
    assert 'id="spec_methods"' in page

    # A tenant's key: the same greedy text; a key that is not a string is the client's error.
    keyed = client.chat.completions.create(**kw, extra_body={"prompt_cache_key": "tenant-a"})
    assert keyed.choices[0].message.content == first.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"prompt_cache_key": 5})
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt_cache_key"


def test_bench_reads_the_acceptance_length_from_metrics(spec_server, server):
    from wafer.benchmark.client import acceptance_length, spec_counters

    before = spec_counters(spec_server.base_url + "/v1")
    st = spec_server.engine.stats.spec
    drafts, accepted = st.drafts, st.accepted_tokens
    client = OpenAI(base_url=spec_server.base_url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt="one two three four one two three four one two", max_tokens=24,
                              temperature=0)
    after = spec_counters(spec_server.base_url + "/v1")
    assert st.drafts > drafts
    assert acceptance_length(before, after) == pytest.approx(1 + (st.accepted_tokens - accepted) / (st.drafts - drafts))
    # A server that does not speculate reports no acceptance length.
    plain = spec_counters(server.base_url + "/v1")
    assert acceptance_length(plain, plain) is None
    assert spec_counters("http://127.0.0.1:9/v1") is None  # nothing listening


def test_prompt_lookup_asked_for_by_one_request_on_a_server_without_speculation(server):
    """wafer's `prompt_lookup` extension: that request's answer is drafted by n-gram lookup (the
    engine's counters move) and is the text it would be without."""
    src = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))
    kw = dict(model=MODEL, temperature=0, max_tokens=80,
              messages=[{"role": "user", "content": f"Copy this code exactly:\n```python\n{src}\n```"}])
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    st = server.engine.stats.spec
    drafts = st.drafts
    plain = client.chat.completions.create(**kw)
    assert st.drafts == drafts  # not asked: the server does not speculate
    looked_up = client.chat.completions.create(**kw, extra_body={"prompt_lookup": True})
    assert st.drafts > drafts and st.accepted_tokens > 0
    assert looked_up.choices[0].message.content == plain.choices[0].message.content
    assert looked_up.usage.completion_tokens == plain.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"prompt_lookup": "yes"})
    assert e.value.body["param"] == "prompt_lookup"


READ = {"type": "function", "function": {"name": "read_file", "description": "Reads a file of the project.",
                                         "parameters": {"type": "object", "properties": {
                                             "path": {"type": "string"}, "start_line": {"type": "integer"}},
                                             "required": ["path", "start_line"]}}}


def _turns(n: int) -> list[dict]:
    """An agent's conversation: n calls of the same tool with the same JSON shape, each answered."""
    messages: list[dict] = [{"role": "user", "content": "Read the engine's modules one by one, from line 1."}]
    for i in range(n):
        args = json.dumps({"path": f"wafer/engine/module_{i}.py", "start_line": 1})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": args}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f{i}():\n    return {i}\n"})
    return messages


def test_tool_calls_and_json_schema_replies_under_drafts_equal_plain(spec_server, server):
    """A required tool call and a `response_format` reply, both under a grammar: drafted (the
    conversation repeats the call's JSON) and kept, and the same call and text as without."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"}},
              "required": ["path", "start_line"], "additionalProperties": False}
    requests = [dict(tools=[READ], tool_choice="required", parallel_tool_calls=False),
                dict(response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": schema,
                                                                              "strict": True}})]
    st = spec_server.engine.stats.spec
    for extra in requests:
        kw = dict(model=MODEL, messages=_turns(4), max_tokens=60, temperature=0, **extra)
        plain = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).chat.completions.create(**kw)
        client = OpenAI(base_url=spec_server.base_url + "/v1", api_key="x", max_retries=0)
        kept = st.accepted_tokens
        fast = client.chat.completions.create(**kw)
        assert st.accepted_tokens > kept, extra  # drafts under the grammar were verified and kept
        a, b = plain.choices[0], fast.choices[0]
        assert b.finish_reason == a.finish_reason and b.message.content == a.message.content
        assert fast.usage.completion_tokens == plain.usage.completion_tokens
        if "tools" in extra:
            assert a.finish_reason == "tool_calls"
            assert [(c.function.name, c.function.arguments) for c in b.message.tool_calls] == \
                [(c.function.name, c.function.arguments) for c in a.message.tool_calls]
            json.loads(b.message.tool_calls[0].function.arguments)
        else:
            assert json.loads(b.message.content).keys() == schema["properties"].keys()
    # What the grammars refused of the drafts is counted as the engine counts it.
    one = "{model_name=" + MODEL + "}"
    assert scrape(spec_server)["wafer:spec_decode_num_grammar_cut_tokens_total" + one] == st.grammar_cut_tokens
