"""Speculative decoding through the server: the SDK sees the same greedy text, streamed or not,
and /metrics carries vLLM's speculative counters."""

from __future__ import annotations

import inspect
import textwrap

import openai
import pytest
from openai import OpenAI

from tests.server.test_metrics import scrape
from tests.serving import MODEL, start_server
from wafer.engine.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def spec_server(smollm):
    s = start_server(smollm, max_running=4, engine_kw={"speculative": SpeculativeConfig.parse("ngram", 6, "fixed")})
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
