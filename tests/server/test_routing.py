"""Several models behind one endpoint: tiers, the auto router, aliases, upstreams and fallbacks."""

from __future__ import annotations


import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import MODEL, free_port, serve_app
from wafer.config import EngineSettings
from wafer.models.loader import load_model
from wafer.router.config import LocalModelConfig, RoutingConfig, ServeConfig, UpstreamConfig
from wafer.router.router import Router
from wafer.server.app import create_app, prompt_counter
from wafer.server.main import build_served


@pytest.fixture(scope="module")
def routed(smollm, tiny_dir, server):
    big = build_served(smollm, ["big"], EngineSettings(max_running=4, max_waiting=16, max_model_len=1024))
    small = build_served(load_model(str(tiny_dir)), ["small"], EngineSettings(max_running=4, max_waiting=16,
                                                                               max_model_len=512))
    cfg = ServeConfig(
        models={"big": LocalModelConfig("big", None), "small": LocalModelConfig("small", str(tiny_dir))},
        upstreams={
            "down": UpstreamConfig("down", f"http://127.0.0.1:{free_port()}/v1", "down-model", timeout=5),
            "cloud": UpstreamConfig("cloud", server.base_url + "/v1", MODEL),
        },
        tiers={"sol": ["down", "big"], "terra": ["big"], "luna": ["small"]},
        aliases={"fast": "luna", "remote": "cloud"},
        routing=RoutingConfig(),
    )
    cfg.check()
    app = create_app([big, small], router=Router(cfg, prompt_counter(big)), upstreams=cfg.upstreams)
    running = serve_app(app, big, small)
    yield running
    running.stop()


def ask(routed, model: str, content: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **kw}
    return httpx.post(routed.base_url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("model,content,served_by,route,tier", [
    ("luna", "Hello", "small", "tier", "luna"),
    ("gpt-5.6-luna", "Hello", "small", "tier", "luna"),
    ("fast", "Hello", "small", "alias", "luna"),
    ("terra", "Hello", "big", "tier", "terra"),
    ("gpt-5.6-terra", "Hello", "big", "tier", "terra"),
    ("auto", "Hi!", "small", "short_prompt", "luna"),
    ("gpt-5.6", "Fix this:\n```python\nprint(1/0)\n```", "big", "code", "terra"),
    ("small", "Hello", "small", "model", ""),
])
def test_names_route_to_models(routed, model, content, served_by, route, tier):
    r = ask(routed, model, content)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == served_by
    assert r.headers["x-wafer-route"] == route and r.headers["x-wafer-tier"] == tier
    assert r.headers["x-wafer-model"] == served_by


def test_upstream_down_falls_back(routed):
    r = ask(routed, "gpt-5.6", "Think hard: what is 2+2?")
    assert r.status_code == 200
    assert r.headers["x-wafer-route"] == "hint" and r.headers["x-wafer-tier"] == "sol"
    assert r.json()["model"] == "big"  # the down upstream was skipped, and the response says who answered
    stream = ask(routed, "sol", "Hello", stream=True)
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    assert '"model": "big"' in stream.text


def test_upstream_serves_alias(routed):
    r = ask(routed, "remote", "Hello")
    assert r.status_code == 200 and r.json()["model"] == MODEL and r.headers["x-wafer-model"] == MODEL
    s = ask(routed, "remote", "Hello", stream=True)
    assert s.status_code == 200 and "data: [DONE]" in s.text and f'"model": "{MODEL}"' in s.text
    bad = ask(routed, "remote", "Hello", temperature=7)  # the upstream's own 400 passes through
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"


def test_models_list_and_route_metrics(routed):
    ids = {m["id"] for m in httpx.get(routed.base_url + "/v1/models").json()["data"]}
    assert {"big", "small", "sol", "terra", "luna", "auto", "gpt-5.6", "fast", "remote"} <= ids
    ask(routed, "auto", "Hi!")
    text = httpx.get(routed.base_url + "/metrics").text
    routes = {(s.labels["rule"], s.labels["tier"]): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "wafer:route_requests_total"}
    assert routes[("short_prompt", "luna")] >= 1
    fallbacks = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "wafer:upstream_fallbacks_total" and s.labels["target"] == "down"]
    assert fallbacks and fallbacks[0] >= 1


def test_an_unknown_model_is_a_404_that_names_what_works(routed):
    """Through the official client: OpenAI's error shape and code, and a message that lists every
    name this server answers to, each tier and alias with what it stands for."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=routed.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    err = e.value
    assert (err.status_code, err.type, err.param, err.code) == (404, "invalid_request_error", "model", "model_not_found")
    assert set(err.body) == {"message", "type", "param", "code"}
    assert err.body["message"] == (
        "The model `gpt-nope` does not exist or you do not have access to it. Served here: models big, small, down, "
        "cloud; tiers sol (down), terra (big), luna (small); auto, gpt-5.6 (a tier per request); aliases gpt-5.6-sol "
        "(sol), gpt-5.6-terra (terra), gpt-5.6-luna (luna), fast (luna), remote (cloud).")
    listed = {m.id for m in client.models.list()}
    assert all(f"{n}" in err.body["message"] for n in listed)
    with pytest.raises(NotFoundError) as card:  # GET /v1/models/{id} answers alike
        client.models.retrieve("gpt-nope")
    assert card.value.body == err.body


def test_the_unknown_model_message_is_bounded():
    from wafer.server.app import ECHOED_NAME_CHARS, LISTED_NAMES, unknown_model

    cfg = ServeConfig(models={f"model-{i}": LocalModelConfig(f"model-{i}", None) for i in range(30)}, upstreams={},
                      tiers={t: ["model-0"] for t in ("sol", "terra", "luna")},
                      aliases={f"alias-{i}": "model-1" for i in range(40)}, routing=RoutingConfig())
    asked = "x" * 10_000
    message = unknown_model(asked, Router(cfg, lambda body: 0)).body()["error"]["message"]
    assert f"`{'x' * (ECHOED_NAME_CHARS - 1)}…`" in message
    assert f"model-{LISTED_NAMES - 1} and {30 - LISTED_NAMES} more;" in message
    assert f"(model-1) and {40 + 3 - LISTED_NAMES} more." in message  # the three gpt-5.6-* first
    assert message.endswith("GET /v1/models lists every name.") and len(message) < 800
