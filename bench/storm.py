"""Abort storm and overload burst against a real `wafer serve` (default model) on loopback.

1. Warm-up: the mix read to the end, then requests with prompts of their own until every block of the KV
   cache has been written once (/metrics' wafer:kv_cache_written_bytes up to wafer:kv_cache_capacity_bytes):
   the cache takes memory on a block's first write and keeps it, a finished request's blocks staying as
   its prefix cache, so any server's resident memory grows to the cache's budget with the variety of what
   it serves. The idle state after that is the baseline: running and waiting requests (/health), KV held
   by live sequences (wafer:kv_cache_usage_perc), resident memory (VmRSS of the server process).
2. Abort storm: `--aborts` requests cut by the client at random points (streamed and not; before the head,
   while queued or prefilling, after a random number of tokens or seconds), `--concurrency` at a time,
   prompts of 16 to 256 tokens, 16 to 64 new tokens. Then the server must come back to the baseline:
   nothing running or waiting, no KV held, resident memory within `--rss-tolerance` of the baseline.
3. Overload burst: `--burst-factor` x `--max-waiting` requests sent at once; each must get 200, or 429 with
   Retry-After and an OpenAI-shaped error body; none 5xx, no connection dropped.

Prints the outcomes by status, the server's state before and after, the resident memory at the start,
middle and end, and PASS/FAIL per criterion; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.common import table  # noqa: E402
from bench.served import Server, judge, log_problems, report_server, server_errors, start  # noqa: E402
from bench.traffic import Outcome, chat, counts, prompt_pool, random_cut, session, warm_up  # noqa: E402
from wafer.benchmark.runner import run_async  # noqa: E402
from wafer.benchmark.workload import Prompt  # noqa: E402

MAX_TOKENS = 64


async def abort_storm(server: Server, model: str, pool: list[Prompt], aborts: int, concurrency: int,
                      rng: random.Random, rss: dict[str, float]) -> list[Outcome]:
    """Requests cut at random points until `aborts` of them were cut; the resident memory when half were."""
    outcomes: list[Outcome] = []
    cut = 0
    issued = 0
    async with session(concurrency) as s:

        async def worker() -> None:
            nonlocal cut, issued
            while cut < aborts:
                i = issued
                issued += 1
                stream = rng.random() < 0.5
                n = rng.randint(16, MAX_TOKENS)
                out = await chat(s, server.base_url, model, rng.choice(pool), n, stream, random_cut(rng, stream, n),
                                 marker=f"[storm {i}] ")
                outcomes.append(out)
                if out.cut:
                    cut += 1
                    if cut == aborts // 2:
                        rss["middle"] = server.rss_mb()
                    if cut % 50 == 0:
                        print(f"  {cut} cut of {len(outcomes)} sent", file=sys.stderr, flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def fill_cache(server: Server, model: str, pool: list[Prompt], batch: int) -> tuple[int, float, float]:
    """Batches of `batch` requests with prompts of their own (a marker each: no prefix is shared) until every
    block of the KV cache has been written once, or a batch wrote none (blocks of another kind, such as a
    windowed pool's, that these prompts do not reach). Returns the requests, and the bytes written and the
    capacity."""
    longest = max(pool, key=lambda p: p.input_len or 0)
    capacity = server.gauge("wafer:kv_cache_capacity_bytes")
    sent = 0
    written = server.gauge("wafer:kv_cache_written_bytes")
    async with session(batch) as s:
        while written < capacity:
            await asyncio.gather(*(chat(s, server.base_url, model, longest, 16, False, marker=f"[fill {sent + i}] ")
                                   for i in range(batch)))
            sent += batch
            before, written = written, server.gauge("wafer:kv_cache_written_bytes")
            if written == before:
                break
    return sent, written, capacity


async def overload(server: Server, model: str, pool: list[Prompt], n: int, rng: random.Random) -> list[Outcome]:
    """n short requests at once, half streamed."""
    short = [p for p in pool if (p.input_len or 0) <= 48]
    async with session(n) as s:
        return list(await asyncio.gather(*(
            chat(s, server.base_url, model, rng.choice(short), 16, i % 2 == 0, marker=f"[burst {i}] ")
            for i in range(n))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="what `wafer serve` serves (default: the "
                    "bundled default model; `wafer serve` with no model serves every installed tier)")
    ap.add_argument("--aborts", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32, help="storm requests in flight")
    ap.add_argument("--max-running", type=int, default=16, help="the server's --max-running (its default)")
    ap.add_argument("--max-waiting", type=int, default=32, help="the server's --max-waiting")
    ap.add_argument("--burst-factor", type=int, default=10)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path("bench/out/storm-server.log"), help="the server's output")
    ap.add_argument("serve_args", nargs="*", help="more `wafer serve` arguments (after --)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pool = prompt_pool(3, args.seed)
    t0 = time.monotonic()
    server = start([args.model, "--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting), *args.serve_args],
                   args.log)
    try:
        model = httpx.get(server.base_url + "/models", timeout=30).json()["data"][0]["id"]
        print(f"wafer serve pid {server.proc.pid} on port {server.port}, model {model}, --max-running "
              f"{args.max_running} --max-waiting {args.max_waiting}; up in {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)
        rss: dict[str, float] = {"loaded": server.rss_mb()}
        t = time.monotonic()
        warm = run_async(warm_up(server.base_url, model, pool, args.max_running, MAX_TOKENS, args.concurrency, rng))
        filled, written, capacity = run_async(fill_cache(server, model, pool, args.max_running))
        print(f"  KV cache: {filled} requests wrote {written / 2**20:.0f} of its {capacity / 2**20:.0f} MB",
              file=sys.stderr, flush=True)
        before, _ = server.wait_idle()
        rss["start"] = before.rss_mb
        print(f"  warm-up: {len(warm)} requests in {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)

        t = time.monotonic()
        storm = run_async(abort_storm(server, model, pool, args.aborts, args.concurrency, rng, rss))
        storm_s = time.monotonic() - t
        after_storm, settle_storm = server.wait_idle()
        rss["end"] = after_storm.rss_mb
        print(f"  storm: {len(storm)} requests in {storm_s:.0f} s", file=sys.stderr, flush=True)

        n_burst = args.burst_factor * args.max_waiting
        t = time.monotonic()
        burst = run_async(overload(server, model, pool, n_burst, rng))
        burst_s = time.monotonic() - t
        after_burst, settle_burst = server.wait_idle()
        rss["after burst"] = after_burst.rss_mb
        errors_seen = server_errors(server)
        problems = log_problems(server)
    finally:
        code = server.stop()

    phases = {"warm-up": counts(warm), "abort storm": counts(storm), "overload burst": counts(burst)}
    labels = sorted(set().union(*phases.values()))
    print(f"\nOutcomes by status ({len(storm)} storm requests in {storm_s:.0f} s; burst of {n_burst} = "
          f"{args.burst_factor} x --max-waiting {args.max_waiting}, in {burst_s:.1f} s)")
    print(table(["outcome", *phases], [[lb, *(str(c.get(lb, 0)) for c in phases.values())] for lb in labels]
                + [["total", *(str(sum(c.values())) for c in phases.values())]]))
    tokens_cut = [o.tokens for o in storm if o.cut and o.stream and o.status == 200]
    if tokens_cut:
        print(f"streamed cuts after the head: {len(tokens_cut)}, cut after 0 to {max(tokens_cut)} chunks "
              f"(median {sorted(tokens_cut)[len(tokens_cut) // 2]})")

    print("\nServer state (/health running and waiting, /metrics wafer:kv_cache_usage_perc, VmRSS)")
    cols = {"idle after warm-up": before, f"after storm (idle in {settle_storm:.1f} s)": after_storm,
            f"after burst (idle in {settle_burst:.1f} s)": after_burst}
    names = ["running requests", "waiting requests", "KV in use (fraction of capacity)", "resident memory MB"]
    print(table(["", *cols], [[nm, *(st.row()[k] for st in cols.values())] for k, nm in enumerate(names)]))

    print("\nResident memory of the server process, MB")
    print(table(["model loaded", "start (after warm-up)", f"middle ({args.aborts // 2} cut)",
                 f"end ({args.aborts} cut, idle)", "after burst"],
                [[f"{rss['loaded']:.1f}", f"{rss['start']:.1f}", f"{rss.get('middle', float('nan')):.1f}",
                  f"{rss['end']:.1f}", f"{rss['after burst']:.1f}"]]))
    growth = rss["end"] / rss["start"] - 1
    report_server(errors_seen, problems, code)

    storm_bad = [o for o in storm if not o.cut and (o.error or o.status not in (200, 429) or
                                                     (o.status == 429 and not o.retry_after))]
    burst_bad = [o for o in burst if o.error or not (o.status == 200 or (o.status == 429 and o.retry_after))]
    checks = [
        (f"storm: at least {args.aborts} requests cut by the client", sum(o.cut for o in storm) >= args.aborts),
        ("storm: no request failed but by its cut (no 5xx, no error event, no dropped connection)", not storm_bad),
        ("after storm: running requests back to idle", after_storm.running == before.running),
        ("after storm: waiting requests back to idle", after_storm.waiting == before.waiting),
        ("after storm: KV in use back to idle", after_storm.kv_usage == before.kv_usage),
        (f"after storm: resident memory within {args.rss_tolerance:.0%} of warm-up ({growth:+.2%})",
         abs(growth) <= args.rss_tolerance),
        (f"burst: all {n_burst} got 200, or 429 with Retry-After and an OpenAI error body; none 5xx", not burst_bad),
        ("burst: it overloaded the server (some 429s)", any(o.status == 429 for o in burst)),
        ("after burst: running, waiting and KV back to idle",
         (after_burst.running, after_burst.waiting, after_burst.kv_usage) ==
         (before.running, before.waiting, before.kv_usage)),
        ("server: no 5xx counted in /metrics, no error in its log",
         not any(s.startswith("5") for s in errors_seen) and not problems),
    ]
    return judge(checks)


if __name__ == "__main__":
    sys.exit(main())
