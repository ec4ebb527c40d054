"""GET /metrics: Prometheus text that parses, with counters that add up to what clients saw."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import MODEL, start_server


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


def test_dashboard_data(fresh):
    d = httpx.get(fresh.base_url + "/dashboard/data").json()
    assert d["model"] == MODEL and d["requests_total"] >= 1 and d["generation_tokens_total"] > 0
    page = httpx.get(fresh.base_url + "/dashboard")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "http" not in httpx.get(fresh.base_url + "/dashboard.js").text.split("fetch(")[1][:20]
