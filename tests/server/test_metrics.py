"""GET /metrics: Prometheus text that parses, with counters that add up to what clients saw and
latencies that agree with what `wafer bench` measured on the same requests."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import MODEL, start_server
from wafer.benchmark.runner import LoadConfig, run_async, run_load
from wafer.benchmark.stats import cell_stats
from wafer.benchmark.workload import synthetic


# Server and client time the same requests from either end of a loopback socket; the issue's bound.
def tolerance(seconds: float) -> float:
    return max(0.1 * seconds, 0.02)


@pytest.fixture(scope="module")
def fresh(smollm):
    s = start_server(smollm, max_running=4)
    yield s
    s.stop()


def scrape(server) -> dict[str, float]:
    r = httpx.get(server.base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_counters_match_usage(fresh):
    from openai import OpenAI

    client = OpenAI(base_url=fresh.base_url + "/v1", api_key="x", max_retries=0)
    prompt_sum = gen_sum = 0
    n = 6
    for i in range(n):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Say a number bigger than {i}."}],
                  max_tokens=8 + i, temperature=0)
        if i % 2:
            chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(**kw).usage
        prompt_sum += usage.prompt_tokens
        gen_sum += usage.completion_tokens
    httpx.post(fresh.base_url + "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    httpx.post(fresh.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    m = scrape(fresh)
    lbl = f"model_name={MODEL}"
    finished = sum(v for k, v in m.items() if k.startswith("wafer:request_success_total{"))
    assert finished == n
    assert m[f"wafer:prompt_tokens_total{{{lbl}}}"] == prompt_sum
    assert m[f"wafer:generation_tokens_total{{{lbl}}}"] == gen_sum
    assert m[f"wafer:time_to_first_token_seconds_count{{{lbl}}}"] == n
    assert m[f"wafer:e2e_request_latency_seconds_count{{{lbl}}}"] == n
    assert m[f"wafer:request_queue_time_seconds_count{{{lbl}}}"] == n
    assert m[f"wafer:request_generation_tokens_sum{{{lbl}}}"] == gen_sum
    assert m[f"wafer:inter_token_latency_seconds_count{{{lbl}}}"] == gen_sum - n
    assert m["wafer:request_errors_total{model_name=,status=400}"] == 1  # HTTP-level: before any model
    assert m["wafer:request_errors_total{model_name=,status=404}"] == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "batch_size"):
        assert f"wafer:{gauge}{{{lbl}}}" in m
    assert m[f"wafer:num_requests_running{{{lbl}}}"] == 0
    # Each short prompt took one step; each token after a request's first, one decode step at most
    # (fewer where speculation verified several at once). A step's time lies within its requests'.
    steps = {k: m[f"wafer:engine_step_seconds_count{{kind={k},{lbl}}}"] for k in ("prompt", "decode")}
    assert steps["prompt"] == n and 0 < steps["decode"] <= gen_sum - n
    step_time = sum(m[f"wafer:engine_step_seconds_sum{{kind={k},{lbl}}}"] for k in steps)
    assert 0 < step_time < m[f"wafer:e2e_request_latency_seconds_sum{{{lbl}}}"]


def test_dashboard_data(fresh):
    from openai import OpenAI

    # A request of its own: the module's other tests may run on another worker.
    OpenAI(base_url=fresh.base_url + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    d = httpx.get(fresh.base_url + "/dashboard/data").json()
    assert d["model"] == MODEL and d["requests_total"] >= 1 and d["generation_tokens_total"] > 0
    page = httpx.get(fresh.base_url + "/dashboard")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "http" not in httpx.get(fresh.base_url + "/dashboard.js").text.split("fetch(")[1][:20]


@pytest.fixture(scope="module")
def benched(smollm):
    """A server that has served nothing but one `wafer bench` run: streamed chat requests of 800
    prompt tokens, four at a time on a server that runs two, so that first tokens wait behind other
    requests' prefill and in the queue, and requests arrive while steps compute (the engine steps on
    the server's event loop: one that arrives mid-step is stamped when the loop next turns, which the
    tolerance covers). Yields the server, the run's records and its report."""
    s = start_server(smollm, max_running=2)
    prompts = synthetic(s.served.tokenizer, 12, 800, 8, seed=19)
    cfg = LoadConfig(s.base_url + "/v1", MODEL, concurrency=4, ignore_eos=True, timeout=300)
    # One prompt alone first, so that the engine has measured what a prompt token costs: until then a
    # step takes max_batched_tokens of prompt (~0.35 s on a 2-core AVX2 host), and a request sent
    # during it is stamped that much late, beyond the tolerance. Its record counts like the others.
    first, _ = run_async(run_load(cfg, synthetic(s.served.tokenizer, 1, 800, 8, seed=7)))
    records, duration = run_async(run_load(cfg, prompts))
    records = first + records
    yield s, records, cell_stats(records, duration, None)
    s.stop()


def histogram(m: dict[str, float], name: str) -> tuple[float, float, dict[float, float]]:
    """_sum, _count and the cumulative bucket counts by upper bound of one model's histogram."""
    lbl = f"model_name={MODEL}"
    buckets = {float(k.split("le=")[1].split(",")[0].rstrip("}")): v for k, v in m.items()
               if k.startswith(f"{name}_bucket{{") and lbl in k}
    return m[f"{name}_sum{{{lbl}}}"], m[f"{name}_count{{{lbl}}}"], buckets


def agree_with_client(m: dict[str, float], name: str, client: list[float]) -> None:
    """The histogram holds the client's values, each within `tolerance`: its mean from _sum/_count,
    and at every bucket bound `le` a count between the client values that are surely below it
    (v + tol <= le) and those that may be (v - tol <= le)."""
    total, count, buckets = histogram(m, name)
    assert count == len(client), name
    mean = sum(client) / len(client)
    assert abs(total / count - mean) <= tolerance(mean), f"{name}: server mean {total / count:.4f} s, client {mean:.4f}"
    for le, n in buckets.items():
        surely = sum(v + tolerance(v) <= le for v in client)
        maybe = sum(v - tolerance(v) <= le for v in client)
        assert surely <= n <= maybe, f"{name}: {n:g} at le={le}, client {sorted(client)}"


def test_latency_histograms_match_wafer_bench(benched):
    server, records, _ = benched
    assert all(r.ok for r in records), [(r.status, r.error) for r in records if not r.ok]
    ttfts = [r.ttft for r in records]
    # The premise: first tokens slow enough that a server recording ~0 is far outside the tolerance.
    assert min(ttfts) > 3 * tolerance(0), ttfts
    m = scrape(server)
    agree_with_client(m, "wafer:time_to_first_token_seconds", ttfts)
    agree_with_client(m, "wafer:e2e_request_latency_seconds", [r.e2e for r in records])


def test_dashboard_percentiles_match_wafer_bench(benched):
    server, records, report = benched
    # A window over the whole run: on a loaded machine it can outlast the dashboard's 60 s.
    d = httpx.get(server.base_url + "/dashboard/data", params={"window": 3600}).json()
    assert d["window_requests"] == len(records)
    assert httpx.get(server.base_url + "/dashboard/data", params={"window": "0"}).status_code == 400
    for mine, theirs in (("ttft", "ttft_s"), ("e2e", "e2e_s")):
        for p in ("p50", "p95"):
            want = report[theirs][p]
            assert abs(d[f"{mine}_{p}"] - want) <= tolerance(want), (mine, p, d[f"{mine}_{p}"], want)
