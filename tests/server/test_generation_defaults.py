"""Sampling defaults through the HTTP API: what a request leaves out comes from the model (or
wafer.toml), what it sets is its own, and /v1/models says what the defaults are."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.serving import MODEL, RunningServer, serve_app
from tests.tiny import with_generation_config
from wafer.engine.sequence import SamplingParams
from wafer.router.config import load_config
from wafer.server.app import create_app
from wafer.server.generation import ServedModel
from wafer.server.main import load_models

HELLO = [{"role": "user", "content": "What is the capital of France?"}]
CARD = {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def spy(served: ServedModel, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The parameters of every sequence the server submits from now on."""
    seen: list[SamplingParams] = []
    submit = served.engine.submit

    def recording(ids, params, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(params)
        return submit(ids, params, *args, **kwargs)

    monkeypatch.setattr(served.engine, "submit", recording)
    return seen


def sampling(p: SamplingParams) -> dict[str, float]:
    return {k: getattr(p, k) for k in CARD}


@pytest.mark.parametrize("seed", range(4))
def test_the_readme_example_answers_with_the_models_defaults(client, seed):
    """The README's example sends no temperature: the card's 0.2 / 0.9 answer it on the default path
    (at 1.0, the old default, the 135M model wanders off)."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of Japan?"}],
                                       seed=seed, max_tokens=40)
    assert "Tokyo" in r.choices[0].message.content


def test_models_say_the_defaults(client):
    assert client.models.retrieve(MODEL).model_extra["sampling_defaults"] == CARD
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert listed[MODEL]["sampling_defaults"] == CARD
    assert "sampling_defaults" not in listed["auto"]  # a routing name has no one model's defaults


def test_the_bundled_models_defaults_fill_what_a_request_leaves_out(server, client, monkeypatch):
    seen = spy(server.served, monkeypatch)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=1.0, top_p=1.0)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0)
    assert [sampling(p) for p in seen] == [CARD, CARD, {**CARD, "temperature": 1.0, "top_p": 1.0},
                                           {**CARD, "temperature": 0.0}]


@pytest.fixture(scope="module")
def tiny_server(tiny_dir, tmp_path_factory) -> Iterator[RunningServer]:
    """A tiny model whose generation_config.json sets every default, wafer.toml overriding two."""
    tmp = tmp_path_factory.mktemp("defaults-server")
    model = with_generation_config(tiny_dir, tmp / "tiny", {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                            "min_p": 0.05, "repetition_penalty": 1.1})
    toml = tmp / "wafer.toml"
    toml.write_text(f"[models.tiny]\npath = '{model}'\nmax_model_len = 256\n"
                    "[models.tiny.sampling]\ntemperature = 0.3\ntop_k = 5\n")
    served = load_models(load_config(toml), quiet=True)
    s = serve_app(create_app(served), served[0])
    yield s
    s.stop()


def test_wafer_toml_wins_over_the_model_and_the_request_over_both(tiny_server, monkeypatch):
    client = OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    seen = spy(tiny_server.served, monkeypatch)
    client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    # Explicit values equal to "off" are values too: top_k 0, min_p 0 and repetition_penalty 1 win.
    client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1, temperature=0.9, top_p=1.0,
                                   extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})
    assert sampling(seen[0]) == {"temperature": 0.3, "top_p": 0.95, "top_k": 5, "min_p": 0.05,
                                 "repetition_penalty": 1.1}
    assert sampling(seen[1]) == {"temperature": 0.9, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                 "repetition_penalty": 1.0}
    assert client.models.retrieve("tiny").model_extra["sampling_defaults"] == sampling(seen[0])

