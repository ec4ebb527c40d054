"""`wafer bench`: its arithmetic on a fake server with known delays, and a sweep against wafer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.serving import free_port, wait_healthy
from wafer.cli import main

FIRST_DELAY, ROLE_DELAY, GAP, CHUNKS = 0.40, 0.15, 0.10, 5
# A sleep never ends early, but on a shared 2-core machine it can end a whole scheduling stall late
# (60 ms seen in CI). So timings through the fake server are held tightly from below (EARLY: clock
# granularity), which catches counting the role chunk or a ping as a token and a gap too many, and
# loosely from above; test_stats_on_exact_records checks the arithmetic itself to the microsecond.
EARLY, LATE = 0.005, GAP


def fake_app() -> FastAPI:
    """Streams CHUNKS one-token chunks: an empty role chunk first (not a token), the first content at
    FIRST_DELAY, then one every GAP. Every 4th request is refused with 429; request 3 sends no usage."""
    app = FastAPI()
    count = {"n": 0}

    @app.get("/health")
    async def health():
        return {}

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
    """The fake server in a process of its own, so that its timing does not wait on this process's GIL."""
    port = free_port()
    code = ("import uvicorn; from tests.benchmark.test_bench import fake_app; "
            f"uvicorn.run(fake_app(), host='127.0.0.1', port={port}, log_level='warning')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


def test_arithmetic_on_known_trace(fake_url, tmp_path):
    rc = main(["bench", "--base-url", fake_url, "--num-prompts", "8", "--warmup", "0", "--concurrency", "1",
               "--input-len", "16", "--output-len", "5", "--slo", "ttft=600,tpot=150",
               "--price-per-mtok", "1,2", "--out", str(tmp_path)])
    assert rc == 0
    cell = json.loads((tmp_path / "results.json").read_text())["cells"][0]
    assert cell["requests"] == 8 and cell["completed"] == 6
    assert cell["errors"] == {"429 rate_limit_error": 2}
    tpot_lo = GAP - (LATE + EARLY) / (CHUNKS - 1)  # TPOT is (e2e - TTFT) / (tokens - 1): a late
    tpot_hi = GAP + (2 * LATE + EARLY) / (CHUNKS - 1)  # first token shortens it
    checks = {
        "ttft_s": (FIRST_DELAY - EARLY, FIRST_DELAY + LATE),  # the empty role chunk does not count
        "e2e_s": (FIRST_DELAY + GAP * (CHUNKS - 1) - EARLY, FIRST_DELAY + GAP * (CHUNKS - 1) + 2 * LATE),
        "itl_s": (GAP - LATE, GAP + LATE),  # a late token shortens the gap after it
        "tpot_s": (tpot_lo, tpot_hi),
        "output_speed_per_stream": (1 / tpot_hi, 1 / tpot_lo),
    }
    for key, (lo, hi) in checks.items():
        assert lo <= cell[key]["p50"] <= hi, (key, lo, cell[key]["p50"], hi)
    # ITL against an independent measure, free of timing noise: every completed request streamed
    # CHUNKS tokens, so its gaps are CHUNKS - 1 and add up to its E2E - TTFT; pooled, the mean gap is
    # the mean decode time over CHUNKS - 1. Counting the pings (or the role chunk) as tokens would
    # make more, shorter gaps over the same decode time.
    decode = cell["e2e_s"]["mean"] - cell["ttft_s"]["mean"]
    assert cell["itl_s"]["mean"] == pytest.approx(decode / (CHUNKS - 1), rel=1e-9), (cell["itl_s"], decode)
    assert cell["token_count_fallbacks"] == 1  # request 3 had no usage
    assert cell["token_count_mismatches"] == 1  # request 5's usage said one token more than the text has
    assert cell["goodput"] > 0 and cell["goodput"] <= cell["request_throughput"]
    expected_cost = (10 * 1 + CHUNKS * 2) / 1e6
    assert abs(cell["cost_per_request"] - expected_cost) < 1e-6 + 2 / 1e6
    assert cell["requests_per_minute"] == pytest.approx(60 * cell["request_throughput"])


def test_stats_on_exact_records():
    from wafer.benchmark.client import RequestRecord
    from wafer.benchmark.stats import cell_stats

    def rec(start: float, times: list[float], usage: int | None) -> RequestRecord:
        return RequestRecord(start, 16, 5, ok=True, status=200, chunk_times=times, text=" hello" * len(times),
                             end=times[-1], usage_prompt=10, usage_completion=usage)

    records = [rec(0.0, [0.4, 0.5, 0.6, 0.7, 0.8], 5),  # TTFT 0.4, gaps 0.1, e2e 0.8, TPOT 0.1
               rec(1.0, [1.2, 1.5, 1.8], 3),  # TTFT 0.2, gaps 0.3, e2e 0.8, TPOT 0.3
               rec(2.0, [2.3, 2.5], None),  # no usage: counted from the text
               RequestRecord(3.0, 16, 5, status=429, error_type="rate_limit_error", end=3.01)]
    cell = cell_stats(records, duration=4.0, tokenizer=None, price=(1.0, 2.0))
    assert cell["completed"] == 3 and cell["errors"] == {"429 rate_limit_error": 1}
    assert cell["ttft_s"]["p50"] == pytest.approx(0.3) and cell["ttft_s"]["mean"] == pytest.approx(0.3)
    assert cell["e2e_s"]["mean"] == pytest.approx((0.8 + 0.8 + 0.5) / 3)
    assert cell["tpot_s"]["p50"] == pytest.approx(0.2)  # of 0.1, 0.3 and 0.2 (one token after the first)
    assert cell["itl_s"]["mean"] == pytest.approx((0.1 * 4 + 0.3 * 2 + 0.2) / 7)
    assert cell["output_speed_per_stream"]["mean"] == pytest.approx((10 + 1 / 0.3 + 5) / 3)
    assert cell["output_tokens"] == 5 + 3 + 2 and cell["token_count_fallbacks"] == 1
    assert cell["request_throughput"] == pytest.approx(3 / 4.0)


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


@pytest.mark.parametrize("mode", ["direct", "ultra"])
def test_bench_drives_the_responses_api_in_a_mode(server, tmp_path, mode):
    rc = main(["bench", "--base-url", server.base_url + "/v1", "--num-prompts", "2", "--warmup", "0",
               "--concurrency", "2", "--input-len", "16", "--output-len", "24", "--endpoint", "responses",
               "--mode", mode, "--subagents", "2", "--out", str(tmp_path)])
    assert rc == 0
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert cell["completed"] == 2 and cell["ttft_s"]["p50"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["mode"] == mode


def test_a_narrow_terminal_gets_each_cell_as_lines(capsys):
    from rich.console import Console

    from wafer.benchmark.report import COLUMNS, terminal_table
    from wafer.benchmark.stats import cell_stats
    from wafer.benchmark.client import RequestRecord

    rec = RequestRecord(0.0, 10, 4, ok=True, status=200, chunk_times=[0.1, 0.2, 0.3], text="a b c", end=0.3)
    cell = {"input_len": 10, "output_len": 4, "concurrency": 1, "request_rate": float("inf"),
            **cell_stats([rec], duration=1.0, tokenizer=None)}
    narrow = Console(width=80, record=True, file=open("/dev/null", "w"))
    terminal_table([cell], narrow)
    text = narrow.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for name, _ in COLUMNS:
        assert any(line.startswith(name) for line in text.splitlines()), name
    wide = Console(width=400, record=True, file=open("/dev/null", "w"))
    terminal_table([cell], wide)
    assert "TTFT p50 ms" in wide.export_text() and "cell 1 of 1" not in wide.export_text()


def test_the_table_goes_to_stdout_and_the_progress_to_stderr(fake_url, tmp_path):
    """`wafer bench ... > file` keeps the results: the table alone on stdout, as a redirect sees it."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as o, err.open("w") as e:
        done = subprocess.run([sys.executable, "-m", "wafer.cli", "bench", "--base-url", fake_url, "--num-prompts",
                               "3", "--warmup", "0", "--concurrency", "1", "--input-len", "16", "--output-len", "5",
                               "--out", str(tmp_path / "results")], stdout=o, stderr=e, timeout=300,
                              cwd=Path(__file__).resolve().parents[2])
    table, diagnostics = out.read_text(), err.read_text()
    assert done.returncode == 0, diagnostics[-2000:]
    # Not a terminal: 80 columns, so each cell comes as `name  value` lines.
    assert "cell 1 of 1" in table and "ok/sent" in table and "TTFT p50 ms" in table
    assert "wrote" not in table and "in 16 out 5 conc 1" not in table  # the paths written, the progress bar
    assert "wrote" in diagnostics and str(tmp_path / "results" / "results.json") in diagnostics


def test_help_shows_the_defaults():
    from wafer.cli import build_parser

    bench = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices["bench"]
    text = " ".join(bench.format_help().split())  # one line: the formatter wraps where the width falls
    for shown in ("(default: http://127.0.0.1:8000/v1)", "(default: chat)", "(default: 128)", "(default: 32)",
                  "(default: 0)", "(default: 600.0)", "(default: the first of /v1/models)",
                  "(default: no pacing)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: inf)" not in text
    assert "TTFT   = time of the first" in bench.format_help()  # the formulas keep their layout
