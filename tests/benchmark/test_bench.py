"""`wafer bench`: its arithmetic on a fake server with known delays, and a sweep against wafer."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.serving import free_port
from wafer.cli import main

FIRST_DELAY, ROLE_DELAY, GAP, CHUNKS = 0.40, 0.15, 0.10, 5
# A sleep never ends early but can end late on a loaded 2-core CI machine (the fake server shares this
# process's GIL with the client). So each timing may be early by at most EARLY (clock granularity)
# and late by at most LATE per sleep, bounds tighter than the mistakes the arithmetic could make
# (counting the role chunk as the first token, a gap too many or too few).
EARLY, LATE = 0.005, 0.045


def fake_app() -> FastAPI:
    """Streams CHUNKS one-token chunks: an empty role chunk first (not a token), the first content at
    FIRST_DELAY, then one every GAP. Every 4th request is refused with 429; request 3 sends no usage."""
    app = FastAPI()
    count = {"n": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        count["n"] += 1
        n = count["n"]
        if n % 4 == 0:
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                           "code": None}}, status_code=429)

        async def events():
            base = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "fake"}
            await asyncio.sleep(ROLE_DELAY)
            yield "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                   "content": ""}}]}) + "\n\n"
            await asyncio.sleep(FIRST_DELAY - ROLE_DELAY)
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(GAP)
                    yield ": ping\n\n"
                yield "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": {"content": " hello"}}]}) + "\n\n"
            if n != 3 and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 10, "completion_tokens": CHUNKS + (1 if n == 5 else 0), "total_tokens": 15}
                yield "data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_url():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    time.sleep(1.0)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    t.join(10)


def test_arithmetic_on_known_trace(fake_url, tmp_path):
    rc = main(["bench", "--base-url", fake_url, "--num-prompts", "8", "--warmup", "0", "--concurrency", "1",
               "--input-len", "16", "--output-len", "5", "--slo", "ttft=600,tpot=150",
               "--price-per-mtok", "1,2", "--out", str(tmp_path)])
    assert rc == 0
    cell = json.loads((tmp_path / "results.json").read_text())["cells"][0]
    assert cell["requests"] == 8 and cell["completed"] == 6
    assert cell["errors"] == {"429 rate_limit_error": 2}
    late_ttft, late_e2e = LATE, 2 * LATE  # the last token waits on every sleep before it
    tpot_lo = GAP - (late_ttft + EARLY) / (CHUNKS - 1)  # TPOT is (e2e - TTFT) / (tokens - 1): a late
    tpot_hi = GAP + (late_e2e + EARLY) / (CHUNKS - 1)  # first token shortens it
    checks = {
        "ttft_s": (FIRST_DELAY - EARLY, FIRST_DELAY + late_ttft),  # the empty role chunk does not count
        "e2e_s": (FIRST_DELAY + GAP * (CHUNKS - 1) - EARLY, FIRST_DELAY + GAP * (CHUNKS - 1) + late_e2e),
        "itl_s": (GAP - LATE, GAP + LATE),  # a late token shortens the gap after it
        "tpot_s": (tpot_lo, tpot_hi),
        "output_speed_per_stream": (1 / tpot_hi, 1 / tpot_lo),
    }
    for key, (lo, hi) in checks.items():
        assert lo <= cell[key]["p50"] <= hi, (key, lo, cell[key]["p50"], hi)
    assert cell["token_count_fallbacks"] == 1  # request 3 had no usage
    assert cell["token_count_mismatches"] == 1  # request 5's usage said one token more than the text has
    assert cell["goodput"] > 0 and cell["goodput"] <= cell["request_throughput"]
    expected_cost = (10 * 1 + CHUNKS * 2) / 1e6
    assert abs(cell["cost_per_request"] - expected_cost) < 1e-6 + 2 / 1e6
    assert cell["requests_per_minute"] == pytest.approx(60 * cell["request_throughput"])


def test_sweep_against_wafer(server, tmp_path):
    rc = main(["bench", "--base-url", server.base_url + "/v1", "--num-prompts", "3", "--warmup", "1",
               "--concurrency", "1,2", "--input-len", "16,48", "--output-len", "6", "--ignore-eos",
               "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["input_len"], c["concurrency"]) for c in data["cells"]}
    assert cells == {(16, 1), (16, 2), (48, 1), (48, 2)}
    for c in data["cells"]:
        assert c["completed"] == 3 and c["token_count_fallbacks"] == 0
        assert c["output_tokens"] == 3 * 6
        assert c["input_tokens"] > 3 * c["input_len"]  # the chat template adds its own tokens
    report = (tmp_path / "report.md").read_text()
    assert report.count("\n| 16 |") + report.count("\n| 48 |") >= 4 and "TPOT" in report
    for png in ("throughput_vs_concurrency.png", "ttft_vs_concurrency.png", "latency_histogram.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_prompts_have_exact_lengths(smollm):
    from wafer.benchmark.workload import synthetic

    prompts = synthetic(smollm.tokenizer, 5, 100, 8, seed=1)
    assert all(p.input_len == 100 for p in prompts)
    assert len({p.text[:20] for p in prompts}) == 5  # unique starts: no prefix-cache flattery
    shared = synthetic(smollm.tokenizer, 3, 100, 8, seed=1, shared_prefix=40)
    ids = [smollm.tokenizer.encode(p.text, add_special_tokens=False) for p in shared]
    assert ids[0][:38] == ids[1][:38] == ids[2][:38]
