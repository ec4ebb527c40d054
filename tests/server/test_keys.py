"""Tenants' keys against a real server with the official `openai` SDK: each limit answers the
request after the one that reached it with a 429, `Retry-After` and the `x-ratelimit-*` headers;
one tenant cannot read, list, continue or delete another's responses; a revoked key is refused at
once; /metrics and the dashboard want an admin key and count tokens, cost and errors by tenant."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import openai
import pytest
from fastapi import Depends, Request

from tests.serving import MODEL, start_server
from wafer.cli import main as wafer
from wafer.server.key_store import KeyStore

MSG = [{"role": "user", "content": "Say hi."}]
LEGACY = "sk-legacy-one"


@pytest.fixture(scope="module")
def keyed(smollm, tmp_path_factory):
    db = tmp_path_factory.mktemp("keys") / "state.db"
    store = KeyStore(db)
    keys = {name: store.add(name, **limits)[0] for name, limits in {
        "alice": {}, "bob": {}, "rpm": {"rpm": 3}, "tpm": {"tpm": 60}, "daily": {"daily_tokens": 90},
        "batchy": {"tpm": 60, "daily_tokens": 60},
        "conc": {"concurrency": 1}, "narrow": {"models": ["some-other-model"]}, "ops": {"admin": True},
        "doomed": {}}.items()}
    s = start_server(smollm, api_keys=[LEGACY], max_running=4, state_db=db, key_store=store,
                     prices={MODEL: {"input": 1.0, "output": 2.0}})
    yield s, keys, db
    s.stop()


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(client: openai.OpenAI, **kw):  # type: ignore[no-untyped-def]
    """A chat completion's raw response: its headers, and the completion."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=3, temperature=0,
                                                           **kw)
    return raw.headers, raw.parse()


def refused(client: openai.OpenAI) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as e:
        ask(client)
    return e.value


def test_requests_per_minute(keyed):
    server, keys, _ = keyed
    client = sdk(server, keys["rpm"])
    left = [ask(client)[0]["x-ratelimit-remaining-requests"] for _ in range(3)]
    assert left == ["2", "1", "0"]
    e = refused(client)
    h = e.response.headers
    assert e.status_code == 429 and e.code == "rate_limit_exceeded" and e.type == "requests"
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(h["retry-after"]) <= 60 and h["x-ratelimit-reset-requests"].endswith("s")


def test_tokens_per_minute(keyed):
    server, keys, _ = keyed
    client = sdk(server, keys["tpm"])
    used = 0
    while used < 60:  # each answered; the one that crosses 60 too
        headers, done = ask(client)
        assert headers["x-ratelimit-remaining-tokens"] == str(max(0, 60 - used))  # before this one's tokens
        used += done.usage.total_tokens
    e = refused(client)
    h = e.response.headers
    assert e.type == "tokens" and h["x-ratelimit-limit-tokens"] == "60" and h["x-ratelimit-remaining-tokens"] == "0"
    assert 1 <= int(h["retry-after"]) <= 60


def test_daily_budget(keyed):
    server, keys, db = keyed
    client = sdk(server, keys["daily"])
    used = 0
    while used < 90:
        used += ask(client)[1].usage.total_tokens
    e = refused(client)
    h = e.response.headers
    assert e.code == "insufficient_quota" and h["x-should-retry"] == "false"
    assert h["x-ratelimit-limit-tokens-per-day"] == "90" and h["x-ratelimit-remaining-tokens-per-day"] == "0"
    assert int(h["retry-after"]) <= 86400
    # the day's use is in the state database, for `wafer keys usage` and for the next server's budget
    deadline = time.monotonic() + 10
    while (tokens := sum(u.tokens for _, _, u in KeyStore(db).usage("0000", "daily"))) < used:
        assert time.monotonic() < deadline, tokens
        time.sleep(0.2)
    assert tokens == used


def test_concurrent_requests(keyed):
    server, keys, _ = keyed
    client = sdk(server, keys["conc"])
    stream = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    e = refused(client)
    assert e.code == "rate_limit_exceeded" and e.response.headers["retry-after"] == "1"
    assert e.response.headers["x-ratelimit-remaining-concurrent-requests"] == "0"
    stream.close()  # the server sees it go, and the key has its request back
    deadline = time.monotonic() + 10
    while True:
        try:
            assert ask(client)[0]["x-ratelimit-limit-concurrent-requests"] == "1"
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_models_a_key_may_use(keyed):
    server, keys, _ = keyed
    client = sdk(server, keys["narrow"])
    with pytest.raises(openai.NotFoundError) as e:
        ask(client)
    assert e.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == []
    assert MODEL in [m.id for m in sdk(server, keys["alice"]).models.list()]


@pytest.mark.parametrize("other", ["bob", "legacy"])
def test_a_tenant_cannot_read_continue_or_delete_another_tenants_responses(keyed, other):
    server, keys, _ = keyed
    alice, them = sdk(server, keys["alice"]), sdk(server, keys[other] if other != "legacy" else LEGACY)
    r = alice.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3)
    item = alice.responses.input_items.list(r.id).data[0].id
    with pytest.raises(openai.NotFoundError):
        them.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        them.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        them.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        them.responses.create(model=MODEL, previous_response_id=r.id, input="And?", max_output_tokens=3)
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        them.responses.create(model=MODEL, input=[{"type": "item_reference", "id": item}], max_output_tokens=3)
    assert "not found" in e.value.message
    # all of it still alice's
    assert alice.responses.retrieve(r.id).id == r.id
    later = alice.responses.create(model=MODEL, previous_response_id=r.id, input="And?", max_output_tokens=3)
    assert later.previous_response_id == r.id
    alice.responses.delete(r.id)


def test_a_revoked_key_is_refused_at_once(keyed):
    server, keys, db = keyed
    client = sdk(server, keys["doomed"])
    assert client.models.list().data
    listed = httpx.get(server.base_url + "/v1/models", headers={"authorization": f"Bearer {keys['doomed']}"})
    assert listed.status_code == 200
    assert wafer(["keys", "revoke", "doomed", "--state-db", str(db)]) == 0  # another process's store would do as much
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        ask(client)


def test_metrics_and_dashboard_want_an_admin_key_and_break_use_down_by_tenant(keyed):
    server, keys, _ = keyed
    ask(sdk(server, keys["alice"]))
    with pytest.raises(openai.NotFoundError):
        ask(sdk(server, keys["narrow"]))
    for path in ("/metrics", "/dashboard", "/dashboard/data"):
        assert httpx.get(server.base_url + path).status_code == 401
        assert httpx.get(server.base_url + path, headers={"authorization": f"Bearer {keys['alice']}"}).status_code \
            == 403
    assert httpx.get(server.base_url + "/dashboard").headers["www-authenticate"] == 'Basic realm="wafer"'
    basic = "Basic " + base64.b64encode(f"any:{keys['ops']}".encode()).decode()  # a browser's, asked by the 401
    assert httpx.get(server.base_url + "/dashboard", headers={"authorization": basic}).status_code == 200
    admin = {"authorization": f"Bearer {keys['ops']}"}
    text = httpx.get(server.base_url + "/metrics", headers=admin).text
    assert 'wafer:tenant_tokens_total{direction="output",tenant="alice"}' in text
    assert 'wafer:tenant_errors_total{status="404",tenant="narrow"}' in text
    assert 'wafer:tenant_rate_limited_total{limit="requests",tenant="rpm"}' in text
    tenants = httpx.get(server.base_url + "/dashboard/data", headers=admin).json()["tenants"]
    alice = tenants["alice"]
    assert alice["input_tokens"] > 0 and alice["output_tokens"] > 0
    assert alice["cost_usd"] == pytest.approx((alice["input_tokens"] * 1.0 + alice["output_tokens"] * 2.0) / 1e6)
    assert httpx.get(server.base_url + "/metrics", headers={"authorization": f"Bearer {LEGACY}"}).status_code == 200


def test_a_request_state_names_its_tenant(keyed):
    """What other routes (the Batch API's) read: request.state.tenant, set by the key's check."""
    server, keys, _ = keyed
    seen: list[object] = []
    app = server.server.config.app
    tenancy = app.state.tenancy
    done = threading.Event()

    async def spy(request: Request) -> None:
        await tenancy.authorize(request)
        seen.append(request.state.tenant)
        done.set()

    app.add_api_route("/spy", lambda: {}, dependencies=[Depends(spy)])
    r = httpx.get(server.base_url + "/spy", headers={"authorization": f"Bearer {keys['bob']}"})
    assert r.status_code == 200, r.text
    assert done.wait(5) and seen == ["bob"]


def test_wafer_bench_runs_with_a_tenants_key_from_the_environment(keyed, tmp_path, monkeypatch):
    import json

    server, keys, _ = keyed
    admin = {"authorization": f"Bearer {keys['ops']}"}
    before = httpx.get(server.base_url + "/dashboard/data", headers=admin).json()["tenants"].get("bob", {})
    monkeypatch.setenv("WAFER_API_KEY", keys["bob"])  # not on the command line, where `ps` shows it
    assert wafer(["bench", "--base-url", server.base_url + "/v1", "--num-prompts", "2", "--warmup", "0",
                  "--input-len", "8", "--output-len", "4", "--out", str(tmp_path)]) == 0
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert cell["completed"] == 2
    after = httpx.get(server.base_url + "/dashboard/data", headers=admin).json()["tenants"]["bob"]
    assert after["requests"] - before.get("requests", 0) == 2


def test_keys_are_not_in_ps_output_or_the_log(tiny_dir, tmp_path):
    """A server started with keys in its state database and in its environment, at debug level,
    asked with a good key, a wrong one and a revoked one: no key in `ps` or in what it logged."""
    import os
    import subprocess
    import sys

    from tests.serving import free_port, serve_process

    db = tmp_path / "state.db"
    store = KeyStore(db)
    good, _ = store.add("alice", rpm=1)
    revoked, _ = store.add("mallory")
    store.revoke("mallory")
    legacy, wrong = "sk-in-the-environment-1234", "sk-wrong-5678"
    port, log = free_port(), tmp_path / "serve.log"
    argv = [sys.executable, "-m", "wafer.cli", "serve", str(tiny_dir), "--quant", "f32", "--port", str(port),
            "--state-db", str(db), "--log-level", "debug", "--max-model-len", "256"]
    with serve_process(argv, port, log, 120, env={**os.environ, "WAFER_API_KEY": legacy}):
        url = f"http://127.0.0.1:{port}/v1/completions"
        codes = [httpx.post(url, json={"model": "x", "prompt": "hi", "max_tokens": 2},
                            headers={"authorization": f"Bearer {k}"}, timeout=60).status_code
                 for k in (good, good, wrong, revoked, legacy)]
        ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
    assert codes[2:4] == [401, 401] and codes[1] == 429, codes
    logged = log.read_text()
    assert "keys: 1 of 1 tenants" in logged
    for key in (good, revoked, legacy, wrong):
        assert key not in ps and key not in logged


def test_batch_lines_count_in_usage_not_against_the_rate_limits(keyed):
    """A batch's tokens are the tenant's use (`wafer keys usage`), but outside its per-minute and daily
    limits, as OpenAI keeps the Batch API's limits apart: a key of 60 tokens a minute runs a batch of
    several times that, and its next interactive request is answered."""
    import io
    import json

    server, keys, db = keyed
    client = sdk(server, keys["batchy"])
    lines = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "messages": MSG, "max_tokens": 3, "temperature": 0}}) + "\n"
                    for i in range(4))
    f = client.files.create(file=("b.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, batch
        time.sleep(0.2)
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    batch_tokens = sum(o["response"]["body"]["usage"]["total_tokens"] for o in out)
    assert len(out) == 4 and batch_tokens > 60
    headers, _ = ask(client)  # answered: the batch's tokens are not in the minute's
    assert headers["x-ratelimit-remaining-tokens"] == "60"
    deadline = time.monotonic() + 10
    key_id = next(k.id for k in KeyStore(db).keys() if k.tenant == "batchy")
    while (use := {k: u.tokens for _, k, u in KeyStore(db).usage("0000", "batchy")}).get(key_id + "/batch") != batch_tokens:
        assert time.monotonic() < deadline, (use, batch_tokens)
        time.sleep(0.2)
