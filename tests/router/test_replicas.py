"""Replicas behind the router (router/replicas.py): the choice between them on its own, then three
real servers behind a real router. Replica A is `wafer serve` in a process of its own (so that it can
be killed), B a wafer server in this process whose every answer waits a second, C a port where
nothing listens."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import MODEL, free_port, serve_app, wait_healthy
from wafer.config import EngineSettings
from wafer.router.config import ConfigError, UpstreamConfig, load_config
from wafer.router.replicas import ReplicaSet, prefix_keys
from wafer.router.router import Router
from wafer.server.app import create_app, prompt_counter
from wafer.server.main import build_served, load_models

URLS = ["http://a/v1", "http://b/v1", "http://c/v1"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool(policy: str = "least_outstanding", **kw) -> tuple[ReplicaSet, Clock]:
    clock = Clock()
    return ReplicaSet(UpstreamConfig("pool", URLS[0], "m", replicas=URLS, policy=policy, **kw), clock), clock


def chat(*turns: str) -> dict:
    messages = [{"role": "system", "content": "You are terse."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "pool", "messages": messages}


def test_least_outstanding_takes_the_idlest_and_takes_turns_on_ties():
    p, _ = pool()
    p.replicas[0].outstanding, p.replicas[1].outstanding, p.replicas[2].outstanding = 2, 0, 1
    assert p.order([])[0].url == "http://b/v1"
    for r in p.replicas:
        r.outstanding = 0
    assert len({p.order([])[0].url for _ in range(3)}) == 3


def test_a_failed_replica_cools_down_longer_each_time_it_fails_again():
    p, clock = pool(cooldown=10.0)
    a = p.replicas[0]
    p.failed(a)
    assert a not in p.healthy() and p.order([])[-1] is a  # tried last, only when every other failed
    clock.now += 10.0
    assert a in p.healthy()
    p.failed(a)
    clock.now += 10.0
    assert a not in p.healthy()  # a second failure in a row: 20 s
    clock.now += 10.0
    assert a in p.healthy()
    p.alive(a)
    p.failed(a)
    clock.now += 10.0
    assert a in p.healthy()  # an answer in between starts it over


def test_prefix_policy_keeps_a_conversation_on_the_replica_that_holds_it():
    p, _ = pool("prefix", balance_slack=2)
    first = chat("Name a prime.")
    p.remember(p.replicas[2], prefix_keys(first))
    p.replicas[2].outstanding = 2  # busier than the others, within the slack
    later = chat("Name a prime.", "Seven.", "And a larger one?")
    assert p.order(prefix_keys(later))[0].url == "http://c/v1"
    p.replicas[2].outstanding = 3  # past the slack: the load wins
    assert p.order(prefix_keys(later))[0].url != "http://c/v1"
    p.replicas[2].outstanding = 0
    other = chat("Something else entirely, and long enough to outweigh the shared system prompt.")
    assert [p.order(prefix_keys(other))[0].url for _ in range(3)] != ["http://c/v1"] * 3  # no affinity: turns


def test_prefix_keys_follow_the_conversation_not_its_last_message():
    a, b = prefix_keys(chat("x", "y", "z")), prefix_keys(chat("x", "y", "w"))
    assert a[:3] == b[:3] and a[3] != b[3]
    long = prefix_keys({"prompt": "p" * 1500})
    assert [size for _, size in long] == [512, 1024, 1500]
    assert prefix_keys({"prompt": ["a", "b"]}) == []


def test_config_takes_replicas_or_base_url(tmp_path):
    toml = tmp_path / "wafer.toml"
    toml.write_text('[upstreams.pool]\nreplicas = ["http://a/v1", "http://b/v1/"]\npolicy = "prefix"\ncooldown = 3\n')
    up = load_config(toml).upstreams["pool"]
    assert up.replicas == ["http://a/v1", "http://b/v1"] and up.policy == "prefix" and up.cooldown == 3.0
    for bad in ['base_url = "http://a/v1"\nreplicas = ["http://b/v1"]', 'replicas = ["http://a/v1"]\npolicy = "random"',
                'replicas = "http://a/v1"', 'replicas = ["http://a/v1"]\ncooldown = -1']:
        toml.write_text(f"[upstreams.pool]\n{bad}\n")
        with pytest.raises(ConfigError):
            load_config(toml)


# --- three real servers behind a real router ------------------------------------------------------

class SlowDown:
    """An ASGI app that answers every POST `delay` seconds late."""

    delay = 1.0

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            await asyncio.sleep(SlowDown.delay)
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def replicas(smollm, tiny_dir, tmp_path_factory):
    port_a = free_port()
    a = subprocess.Popen([sys.executable, "-m", "wafer.cli", "serve", MODEL, "--port", str(port_a), "--max-running", "8"],
                         cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    b_served = build_served(smollm, [MODEL], EngineSettings(max_running=8, max_model_len=2048))
    b = serve_app(SlowDown(create_app(b_served)), b_served)
    # Bound and never listening: connections to it are refused, and no server another test process
    # starts meanwhile can take its port (a free port merely looked up was taken by one, once).
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    urls = {"a": f"http://127.0.0.1:{port_a}/v1", "b": b.base_url + "/v1",
            "c": f"http://127.0.0.1:{dead.getsockname()[1]}/v1"}
    replicas_toml = ", ".join(f'"{u}"' for u in urls.values())
    toml = tmp_path_factory.mktemp("replicas") / "wafer.toml"
    toml.write_text(f"""
[models.local]
path = "{tiny_dir}"
quant = "f32"
max_running = 2
max_model_len = 256

[upstreams.affine]
replicas = [{replicas_toml}]
model = "{MODEL}"
policy = "prefix"
cooldown = 60

[upstreams.balanced]
replicas = [{replicas_toml}]
model = "{MODEL}"
cooldown = 60
""")
    cfg = load_config(toml)
    served = load_models(cfg, quiet=True)
    front = serve_app(create_app(served, router=Router(cfg, prompt_counter(served[0])), upstreams=cfg.upstreams),
                      *served)
    try:
        wait_healthy(urls["a"][: -len("/v1")], 120)
        yield front, urls, a
    finally:
        front.stop()
        b.stop()
        dead.close()
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        a.wait(30)


def ask(front, model: str, messages: list[dict], max_tokens: int = 8) -> httpx.Response:
    r = httpx.post(front.base_url + "/v1/chat/completions", timeout=120,
                   json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def replica_metrics(front) -> dict[tuple[str, str, str], float]:
    text = httpx.get(front.base_url + "/metrics").text
    return {(s.name, s.labels["upstream"], s.labels["replica"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("wafer:replica_")}


def test_one_conversation_stays_on_one_replica_and_its_prefix_is_cached(replicas):
    front, urls, _ = replicas
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    served_by, cached = [], []
    for turn in range(3):
        r = ask(front, "affine", messages)
        served_by.append(r.headers["x-wafer-replica"])
        cached.append(r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"And question {turn + 2}?"}]
    assert len(set(served_by)) == 1 and served_by[0] != urls["c"], served_by
    assert cached[0] < cached[1] < cached[2], cached
    # The replica where nothing listens was tried once at most, then left out.
    m = replica_metrics(front)
    assert m[("wafer:replica_errors_total", "affine", urls["c"])] <= 1
    if m[("wafer:replica_errors_total", "affine", urls["c"])]:
        assert m[("wafer:replica_healthy", "affine", urls["c"])] == 0


def test_least_outstanding_sends_less_to_the_slow_replica(replicas):
    front, urls, _ = replicas
    out: list[str] = []

    def one(i: int) -> None:
        r = ask(front, "balanced", [{"role": "user", "content": f"Count to {i}."}], max_tokens=4)
        out.append(r.headers["x-wafer-replica"])

    # Least outstanding sends each replica a share that follows its speed. On two cores shared by the
    # front, both replicas and the client, the fast replica's own latency can reach a second or two;
    # the slow one holds every request it gets for longer than the whole run of arrivals, so the fast
    # one gets more as long as it finishes any within that run.
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    SlowDown.delay = 6.0
    try:
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join()
    finally:
        SlowDown.delay = 1.0
    assert len(out) == 16 and urls["c"] not in out
    assert out.count(urls["a"]) > out.count(urls["b"]), out


def test_a_replica_killed_mid_run_costs_no_request(replicas):
    front, urls, a = replicas
    results: list[int] = []

    def one(i: int) -> None:
        r = httpx.post(front.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "balanced", "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write a short poem about the number {i}."}]})
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # requests are in flight on both replicas
    os.killpg(a.pid, signal.SIGKILL)
    for t in threads:
        t.join()
    assert results == [200] * 8, results
    r = ask(front, "balanced", [{"role": "user", "content": "Still there?"}])
    assert r.headers["x-wafer-replica"] == urls["b"]
