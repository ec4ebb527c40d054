"""The official openai SDK against a real wafer server: the wire format, parameter by parameter."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving import MODEL

# The default path (q4, int8 activations, as llama.cpp's) answers this one greedily; "the capital of
# France?" it answers "L'Étoile, ..." there, as llama.cpp does on the same file (f32 says Paris).
HELLO = [{"role": "user", "content": "What is the capital of Japan?"}]


def test_models(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == MODEL
    # Without a configuration the model serves every tier, under the names the articles use.
    assert set(ids) == {MODEL, "sol", "terra", "luna", "auto", "gpt-5.6", "gpt-5.6-sol", "gpt-5.6-terra",
                        "gpt-5.6-luna"}
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve("gpt-5.6-luna").id == "gpt-5.6-luna"


def test_chat_non_streaming(client, smollm):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=40)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.created > 0 and r.system_fingerprint.startswith("fp_")
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and "Tokyo" in c.message.content
    assert c.finish_reason == "stop"
    prompt = smollm.chat_template.render(HELLO)
    assert r.usage.prompt_tokens == len(smollm.tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Earlier requests may have left this prompt's prefix in the cache; the last token is always computed.
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    # The completion is the answer plus the end-of-turn token.
    assert r.usage.completion_tokens == len(smollm.tokenizer.encode(c.message.content, add_special_tokens=False)) + 1


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write two sentences about rain."}],
              temperature=0, max_tokens=48)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_no_usage_chunk_unless_asked(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, stream=True))
    assert all(c.choices for c in chunks)


def test_max_completion_tokens_and_length(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_n_choices(client):
    story = [{"role": "user", "content": "Tell me a story."}]  # open enough that two samples differ
    r = client.chat.completions.create(model=MODEL, messages=story, n=2, max_tokens=12, temperature=1.0, seed=5,
                                       logprobs=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=6, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 2


def test_stop(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
              temperature=0, max_tokens=60)
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert "5" in full
    r = client.chat.completions.create(**kw, stop=["5"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index("5")]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stop="5", stream=True))
    assert streamed == r.choices[0].message.content


def test_seed_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a fun fact."}], temperature=1.0,
              max_tokens=24)
    a = client.chat.completions.create(**kw, seed=42).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=42).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=43).choices[0].message.content
    assert a == b != c


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens == 6
    for entry in lp:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert bytes(b for e in lp for b in e.bytes).decode() == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=6,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in lp]


def test_content_parts_and_unknown_fields(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=10,
        messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                               {"type": "text", "text": "of France?"}]}],
        user="u1", metadata={"k": "v"}, extra_body={"some_future_field": {"x": 1}},
    )
    assert r.choices[0].message.content


def test_penalties_and_logit_bias_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8,
                                       presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"504": -100})
    assert r.choices[0].message.content
    biased = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=1,
                                            logit_bias={"504": -100}, logprobs=True)
    assert biased.choices[0].logprobs.content[0].token != "The"


def test_legacy_completions(client, smollm):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == len(smollm.tokenizer.encode("The capital of France is"))
    ids = smollm.tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == "The capital of France is" + r.choices[0].text
    lp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                   logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 4 and len(lp.choices[0].logprobs.top_logprobs[0]) == 2
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_async_client(aclient):
    async def run():
        r = await aclient.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=20)
        stream = await aclient.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=20,
                                                       stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        comp = await aclient.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        return r.choices[0].message.content, text, comp

    whole, streamed, comp = asyncio.run(run())
    assert whole == streamed and comp.choices[0].text is not None


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_plain_endpoints(server, path):
    import httpx

    assert httpx.get(server.base_url + path).status_code == 200


def test_second_turn_reports_cached_tokens(client):
    turn1 = [{"role": "user", "content": "Give me a one-line fun fact about octopuses."}]
    r1 = client.chat.completions.create(model=MODEL, messages=turn1, temperature=0, max_tokens=30)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Another one, about squids."}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=5)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens < cached < r2.usage.prompt_tokens  # the history came from the prefix cache
