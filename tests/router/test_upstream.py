"""Upstreams that fail, behind a router configured by a wafer.toml: a timeout, a 5xx, a body that is
not JSON, a 429, a stream that stalls half-way, and every target of a tier failing. Each upstream is
a real HTTP server on loopback (its own process, so its sleeps never wait on this one's GIL); the
router is `wafer serve --config`'s own assembly. Every outcome is a fallback or an OpenAI-shaped error."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import free_port, serve_app, wait_healthy
from wafer.router.config import load_config
from wafer.router.router import Router
from wafer.server.app import create_app, prompt_counter
from wafer.server.main import load_models

TIMEOUT = 1.0  # the router's timeout for every upstream here; the slow ones take far longer
SLOW = 60.0
STALL_AFTER = ["Hel", "lo"]  # what the stalling upstream streams before it stops


def fake_upstreams() -> FastAPI:
    """One server, one behaviour per path prefix: /ok, /slow, /e500, /notjson, /limit, /stall, and
    /keys, which answers with the body's field names."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    def chunk(model: str, delta: dict) -> str:
        return "data: " + json.dumps({"id": "up-1", "object": "chat.completion.chunk", "created": 1, "model": model,
                                      "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"

    @app.post("/{kind}/v1/chat/completions")
    async def chat(kind: str, request: Request):
        body = await request.json()
        model, stream = body["model"], body.get("stream", False)
        if kind == "slow" or (kind == "stall" and not stream):
            await asyncio.sleep(SLOW)
        if kind == "e500":
            return JSONResponse({"error": {"message": "upstream broke", "type": "server_error", "param": None,
                                           "code": None}}, status_code=500)
        if kind == "notjson":
            return Response("<html><body>502 Bad Gateway</body></html>", media_type="text/html")
        if kind == "limit":
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                           "code": "rate_limit_exceeded"}}, status_code=429, headers={"Retry-After": "7"})
        if not stream:
            said = ",".join(sorted(body)) if kind == "keys" else "from " + kind
            return {"id": "up-1", "object": "chat.completion", "created": 1, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": said},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

        async def events():
            yield chunk(model, {"role": "assistant", "content": ""})
            for piece in STALL_AFTER if kind == "stall" else ["from ", kind]:
                yield chunk(model, {"content": piece})
            if kind == "stall":
                yield 'data: {"id": "up-1", "choi'  # half an event, then nothing
                await asyncio.sleep(SLOW)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def upstream_base():
    port = free_port()
    code = ("import uvicorn; from tests.router.test_upstream import fake_upstreams; "
            f"uvicorn.run(fake_upstreams(), host='127.0.0.1', port={port}, log_level='warning')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def routed(upstream_base, tiny_dir, tmp_path_factory):
    refused = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    ups = "\n".join(f'[upstreams.{name}]\nbase_url = "{upstream_base}/{name}/v1"\nmodel = "up-{name}"\n'
                    f"timeout = {TIMEOUT}\n" for name in ("ok", "slow", "e500", "notjson", "limit", "stall", "keys"))
    toml = tmp_path_factory.mktemp("router") / "wafer.toml"
    toml.write_text(f"""
[models.local]
path = "{tiny_dir}"
quant = "f32"
max_running = 4
max_model_len = 512
{ups}
[upstreams.refused]
base_url = "{refused}"
timeout = {TIMEOUT}

[upstreams.wafer_keys]
base_url = "{upstream_base}/keys/v1"
model = "up-keys"
wafer = true

[tiers]
sol = ["slow", "local"]
terra = ["e500", "notjson", "local"]
luna = ["refused", "e500", "notjson", "slow"]
""")
    cfg = load_config(toml)
    served = load_models(cfg, quiet=True)
    app = create_app(served, router=Router(cfg, prompt_counter(served[0])), upstreams=cfg.upstreams)
    running = serve_app(app, *served)
    yield running
    running.stop()


def ask(routed, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0,
            **kw}
    return httpx.post(routed.base_url + "/v1/chat/completions", json=body, timeout=60)


def openai_error(r: httpx.Response) -> dict:
    """The body's error object, after checking it has exactly OpenAI's shape."""
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def fallbacks(routed) -> dict[str, float]:
    text = httpx.get(routed.base_url + "/metrics").text
    return {s.labels["target"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "wafer:upstream_fallbacks_total"}


def test_a_healthy_upstream_answers(routed):
    r = ask(routed, "ok")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "from ok"
    assert r.headers["x-wafer-model"] == "up-ok"
    s = ask(routed, "ok", stream=True)
    assert s.status_code == 200 and s.text.rstrip().endswith("data: [DONE]") and '"from "' in s.text


def test_wafer_only_fields_are_not_passed_to_an_upstream(routed):
    """`prompt_lookup` is wafer's: OpenAI refuses a field it does not know, so it stays here, unless
    the upstream is marked as a wafer server; the other fields go on."""
    r = ask(routed, "keys", prompt_lookup=True, top_p=0.5)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"].split(",") == ["max_tokens", "messages", "model",
                                                                       "temperature", "top_p"]
    r = ask(routed, "wafer_keys", prompt_lookup=True)  # an upstream marked as a wafer server gets them
    assert r.json()["choices"][0]["message"]["content"].split(",") == ["max_tokens", "messages", "model",
                                                                       "prompt_lookup", "temperature"]


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_falls_back_after_the_timeout(routed, stream):
    before = fallbacks(routed).get("slow", 0)
    t0 = time.monotonic()
    r = ask(routed, "sol", stream=stream)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.headers["x-wafer-model"] == "local"  # the slow upstream was given up on
    assert TIMEOUT <= took < TIMEOUT + 3, took  # it waited the timeout, not the upstream's 60 s (nor httpx's own 5)
    assert fallbacks(routed)["slow"] == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_5xx_and_a_body_that_is_not_json_fall_back(routed, stream):
    before = fallbacks(routed)
    r = ask(routed, "terra", stream=stream)
    assert r.status_code == 200, r.text
    assert r.headers["x-wafer-model"] == "local"
    after = fallbacks(routed)
    assert after["e500"] == before.get("e500", 0) + 1 and after["notjson"] == before.get("notjson", 0) + 1


@pytest.mark.parametrize("stream", [False, True])
def test_every_target_failing_is_a_503_in_openai_shape(routed, stream):
    r = ask(routed, "luna", stream=stream)
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = openai_error(r)
    assert err["type"] == "server_error" and err["code"] == "upstream_unavailable"
    for name in ("refused", "e500", "notjson", "slow"):  # each failure is named
        assert name + ":" in err["message"], err["message"]
    assert httpx.get(routed.base_url + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_target_that_is_not_json_is_a_503_not_a_crash(routed, stream):
    r = ask(routed, "notjson", stream=stream)
    assert r.status_code == 503, r.text
    assert openai_error(r)["code"] == "upstream_unavailable"


def test_upstream_429_reaches_the_client_in_openai_shape(routed):
    from openai import OpenAI, RateLimitError

    r = ask(routed, "limit")
    assert r.status_code == 429
    assert openai_error(r)["type"] == "rate_limit_error"
    assert r.headers["retry-after"] == "7"  # the upstream's wait, passed on for the client to honour
    client = OpenAI(base_url=routed.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(RateLimitError):
        client.chat.completions.create(model="limit", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)


def test_stream_that_stalls_midway_ends_with_an_error_event(routed):
    """Bytes already went to the client, so there is no falling back: what came is kept, the half
    event is dropped, and an OpenAI-shaped error event ends the stream once the upstream has been
    silent for its timeout (the SDK raises it as an APIError)."""
    from openai import APIError, OpenAI

    client = OpenAI(base_url=routed.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    got = []
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        for c in client.chat.completions.create(model="stall", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, stream=True):
            got.append(c.choices[0].delta.content or "")
    assert time.monotonic() - t0 < TIMEOUT + 3
    assert "".join(got) == "".join(STALL_AFTER)
    assert "stall" in e.value.message
    raw = httpx.post(routed.base_url + "/v1/chat/completions", timeout=60,
                     json={"model": "stall", "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    events = [line.removeprefix("data: ") for line in raw.text.split("\n\n") if line.startswith("data: ")]
    last = json.loads(events[-1])  # every event parses: the half one was not passed on
    assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}
    assert last["error"]["type"] == "server_error" and last["error"]["code"] == "upstream_unavailable"
    assert [json.loads(ev)["choices"][0]["delta"].get("content") for ev in events[:-1]] == ["", *STALL_AFTER]
    assert httpx.get(routed.base_url + "/health").status_code == 200


def test_local_fallback_that_fails_is_a_500_in_openai_shape(routed, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(routed.engine.runner, "run", broken)
    r = ask(routed, "terra")  # e500 and notjson fall back to the local model, which fails
    assert r.status_code == 500, r.text
    err = openai_error(r)
    assert err["type"] == "server_error" and "request id chatcmpl-" in err["message"]
    monkeypatch.undo()
    routed.wait_idle()
    assert ask(routed, "terra").status_code == 200
