"""Soak: `--streams` clients against a real `wafer serve` (default model) on loopback for `--minutes`.

Each client sends one chat completion after another: prompts of 16 to 256 tokens, 16 to 64 new tokens
(EOS ignored), half streamed; `--abort-fraction` of them are cut by the client at a random point (as in
bench/storm.py). Every `--report-every` minutes it prints what ended in that window by outcome, the
tokens read per second, the server's running and waiting requests and KV in use at that moment, and its
resident memory (VmRSS) with the growth since minute `--baseline-minute`. At the end the clients finish
their requests, the server must come back to idle, and it prints PASS/FAIL for: no error other than the
deliberate cuts, resident memory growth under `--rss-tolerance` from the baseline minute to the end.

A script of its own rather than `wafer bench --duration`: wafer bench drives a URL, so it cannot read the
server process's memory, and it has no cuts to mix in; here the same server is started, sampled and
stopped by the one script.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.common import table  # noqa: E402
from bench.served import Server, judge, log_problems, report_server, server_errors, start  # noqa: E402
from bench.traffic import Cut, Outcome, chat, prompt_pool, random_cut, session, warm_up  # noqa: E402
from wafer.benchmark.runner import run_async  # noqa: E402
from wafer.benchmark.workload import Prompt  # noqa: E402

OUTPUT_LENS = (16, 32, 64)
HEADERS = ["minute", "ended", "completed", "cut (deliberate)", "errors", "tokens/s", "running", "waiting",
           "KV in use", "RSS MB", "RSS peak MB", "RSS vs baseline"]


async def soak(server: Server, model: str, pool: list[Prompt], args: argparse.Namespace,
               rng: random.Random) -> tuple[list[Outcome], dict[float, float]]:
    """The clients until the deadline, and a reporter; returns every outcome and the RSS at each report."""
    outcomes: list[Outcome] = []
    rss_at: dict[float, float] = {}
    start_t = time.monotonic()
    deadline = start_t + args.minutes * 60
    sent = 0

    async def client(s) -> None:  # type: ignore[no-untyped-def]
        nonlocal sent
        while time.monotonic() < deadline:
            i = sent
            sent += 1
            stream = rng.random() < 0.5
            n = rng.choice(OUTPUT_LENS)
            cut = random_cut(rng, stream, n) if rng.random() < args.abort_fraction else Cut()
            outcomes.append(await chat(s, server.base_url, model, rng.choice(pool), n, stream, cut,
                                       marker=f"[soak {i}] "))

    async def reporter() -> None:
        seen = 0
        peak = 0.0
        window_start = start_t
        minute = 0.0
        while minute < args.minutes:
            next_report = min(minute + args.report_every, args.minutes)
            while time.monotonic() < start_t + next_report * 60:
                peak = max(peak, server.rss_mb())
                await asyncio.sleep(min(5.0, max(0.0, start_t + next_report * 60 - time.monotonic())))
            minute = next_report
            st = await asyncio.to_thread(server.state)
            rss_at[minute] = st.rss_mb
            peak = max(peak, st.rss_mb)
            window = outcomes[seen:]
            seen += len(window)
            now = time.monotonic()
            print(table(HEADERS, [_row(f"{minute:g}", window, now - window_start, st.running, st.waiting,
                                       st.kv_usage, st.rss_mb, peak, _vs(rss_at, args.baseline_minute, st.rss_mb))]),
                  flush=True)
            window_start, peak = now, 0.0

    async with session(args.streams) as s:
        await asyncio.gather(reporter(), *(client(s) for _ in range(args.streams)))
    return outcomes, rss_at


def _row(minute: str, window: list[Outcome], seconds: float, running: int | str, waiting: int | str,
         kv: float | str, rss: float, peak: float | str, vs: str) -> list[str]:
    errors = sum(1 for o in window if is_error(o))
    return [minute, str(len(window)), str(sum(1 for o in window if not o.cut and not is_error(o))),
            str(sum(o.cut for o in window)), str(errors), f"{sum(o.tokens for o in window) / seconds:.1f}",
            str(running), str(waiting), kv if isinstance(kv, str) else f"{kv:.4f}", f"{rss:.1f}",
            peak if isinstance(peak, str) else f"{peak:.1f}", vs]


def _vs(rss_at: dict[float, float], baseline: float, rss: float) -> str:
    if baseline not in rss_at:
        return "-"
    return f"{rss / rss_at[baseline] - 1:+.2%}"


def is_error(o: Outcome) -> bool:
    """Anything but an answer read to its end with 200, or a deliberate cut."""
    return not o.cut and (o.error is not None or o.status != 200)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="what `wafer serve` serves (default: the "
                    "bundled default model; `wafer serve` with no model serves every installed tier)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--streams", type=int, default=32, help="concurrent clients")
    ap.add_argument("--abort-fraction", type=float, default=0.1, help="requests the client cuts on purpose")
    ap.add_argument("--report-every", type=float, default=5.0, help="minutes between rows")
    ap.add_argument("--baseline-minute", type=float, default=5.0,
                    help="memory growth is measured from this report (it must be one of the rows)")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--max-running", type=int, default=16, help="the server's --max-running (its default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path("bench/out/soak-server.log"), help="the server's output")
    ap.add_argument("serve_args", nargs="*", help="more `wafer serve` arguments (after --)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pool = prompt_pool(3, args.seed)
    server = start([args.model, "--max-running", str(args.max_running), *args.serve_args], args.log)
    try:
        model = httpx.get(server.base_url + "/models", timeout=30).json()["data"][0]["id"]
        loaded = server.rss_mb()
        t = time.monotonic()
        run_async(warm_up(server.base_url, model, pool, args.max_running, max(OUTPUT_LENS), args.streams, rng))
        warm, _ = server.wait_idle()
        print(f"wafer serve {model} (pid {server.proc.pid}, --max-running {args.max_running}); resident memory "
              f"{loaded:.1f} MB loaded, {warm.rss_mb:.1f} MB after a warm-up of {time.monotonic() - t:.0f} s; "
              f"{args.streams} streams for {args.minutes:g} minutes, {args.abort_fraction:.0%} cut on purpose",
              flush=True)
        outcomes, rss_at = run_async(soak(server, model, pool, args, rng))
        idle, settle = server.wait_idle()
        errors_seen = server_errors(server)
        problems = log_problems(server)
    finally:
        code = server.stop()

    print(f"\nAfter the last requests ended, idle in {settle:.1f} s:")
    print(table(["", "running", "waiting", "KV in use", "RSS MB", "RSS vs baseline"],
                [["end (idle)", str(idle.running), str(idle.waiting), f"{idle.kv_usage:.4f}", f"{idle.rss_mb:.1f}",
                  _vs(rss_at, args.baseline_minute, idle.rss_mb)]]))
    by = Counter(o.label for o in outcomes)
    print(f"\nOutcomes by status, whole run ({len(outcomes)} requests, "
          f"{sum(o.stream for o in outcomes)} streamed)")
    print(table(["outcome", "count"], [[k, str(v)] for k, v in sorted(by.items())]))
    report_server(errors_seen, problems, code)

    end = max(rss_at)
    growth = rss_at[end] / rss_at[args.baseline_minute] - 1 if args.baseline_minute in rss_at else float("nan")
    errors = [o for o in outcomes if is_error(o)]
    checks = [
        (f"0 errors other than deliberate cuts ({len(errors)})", not errors),
        (f"resident memory growth from minute {args.baseline_minute:g} to minute {end:g} under "
         f"{args.rss_tolerance:.0%} ({growth:+.2%})", growth < args.rss_tolerance),
        ("after the soak: nothing running or waiting, no KV in use",
         (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)),
        ("server: no 5xx counted in /metrics, no error in its log",
         not any(s.startswith("5") for s in errors_seen) and not problems),
    ]
    return judge(checks)


if __name__ == "__main__":
    sys.exit(main())
