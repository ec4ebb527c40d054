"""Fuzz a real `wafer serve` (default model) on loopback with `--requests` generated requests.

The generators and the judgement are those of tests/server/test_fuzz.py (bench/fuzz_requests.py,
bench/fuzz_run.py), run longer: schemathesis's cases from /openapi.json and hypothesis's broken JSON,
odd encodings, pathological schemas, extreme numbers, long strings and deep nesting, `--concurrency`
at a time. Prints the counts by status, the 5xx and malformed error bodies, the longest stall of the
server's event loop and the engine steps over 100 ms (from /metrics; what they computed, from the
server's lines at info, at most one every 10 s) and PASS/FAIL per criterion, then each failing request; exits 1 if
any criterion failed. A timer on the loop sees a hold only from when it was due, up to its 50 ms
interval less than the hold, so a step over 100 ms fails the run even where no stall did. The
server's log is in bench/out/fuzz-server.log, the failing requests whole in
bench/out/fuzz-failures.jsonl.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.fuzz_requests import WEIGHTS  # noqa: E402
from bench.fuzz_run import STALL_LIMIT, run_fuzz  # noqa: E402
from bench.served import start  # noqa: E402

LOG = Path(__file__).resolve().parent / "out" / "fuzz-server.log"
FAILURES = LOG.parent / "fuzz-failures.jsonl"  # each failing request whole, to replay
# Without a model `wafer serve` loads every installed tier; the probe fuzzed the default one.
MODEL = "SmolLM2-135M-Instruct"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=None, help="hypothesis's seed (default: a random one, printed)")
    ap.add_argument("--concurrency", type=int, default=16,
                    help="requests in flight; with 1, each loop stall is attributed to its request")
    ap.add_argument("--bound", type=float, default=30.0, help="seconds each answer must come within")
    ap.add_argument("--only", action="append", default=None, metavar="GENERATOR",
                    help=f"this generator alone (repeatable): {', '.join(WEIGHTS)}")
    ap.add_argument("--model", default=MODEL, help=f"what `wafer serve` serves (default {MODEL}, the default model)")
    ap.add_argument("--client-nice", type=int, default=19,
                    help="the nice value this client runs at once the server is up (default 19)")
    ap.add_argument("--serve-arg", action="append", default=[], help="another argument for `wafer serve` (repeatable)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)

    # At info, the server logs engine steps over 100 ms with what they computed (printed below).
    server = start([args.model, "--log-level", "info", *args.serve_arg], LOG)
    # The client's hypothesis work shares this machine's cores with the server; a remote client costs
    # the server none. At nice 19 it takes what the server leaves, so the stalls measured are the
    # server's own (--client-nice 0: the two compete as equals).
    os.nice(args.client_nice)
    try:
        model = httpx.get(server.root + "/health", timeout=30).json()["models"][0]["name"]
        # The first step warms the kernels and thread pools; that stall is start-up, not a request's.
        httpx.post(server.root + "/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello."}]}).raise_for_status()
        print(f"fuzzing `wafer serve {' '.join([args.model, *args.serve_arg])}` with {args.requests} requests, "
              f"seed {seed}, {args.concurrency} at a time", flush=True)
        FAILURES.unlink(missing_ok=True)
        report = run_fuzz(server.root, model, args.requests, seed, args.concurrency, args.bound, progress=True,
                          only=args.only, failures=FAILURES)
    finally:
        code = server.stop()
    log = LOG.read_text(errors="replace")
    tracebacks = log.count("Traceback (most recent call last)")

    print()
    print(report.summary())
    print(f"server log: {tracebacks} tracebacks; exit code {code}")
    checks = [
        (f"at least {args.requests} requests", len(report.outcomes) >= args.requests),
        ("0 responses 5xx", report.server_errors == 0),
        ("0 error bodies outside the OpenAI shape", report.malformed == 0),
        (f"every answer within {args.bound:g} s, on a connection kept, streams complete", not report.problems),
        ("healthy afterwards (/health 200, nothing running, a chat answered)", report.healthy is None),
        (f"nothing held the event loop over {STALL_LIMIT * 1000:.0f} ms during the run (a timer due on it, or an "
         f"engine step)", report.stalls_during() == 0 and report.slow_steps() == 0),
    ]
    print()
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if report.problems:
        print(f"\n{len(report.problems)} failing requests (first 40; all, whole, in {FAILURES}):")
        for o in report.problems[:40]:
            print(f"- {o.status} after {o.seconds:.1f} s: {o.problem}\n    {o.request.reproduction()}")
    # An engine step holds the loop: these are stalls whose cause the server knows. /metrics counts them
    # all; at info the server logs what the first computed and then at most one every 10 s, each line
    # with a count of those it held back (the rest are at debug).
    slow_steps = [line.split(" INFO ", 1)[-1] for line in log.splitlines() if "step took" in line]
    if slow_steps:
        print(f"\n{report.slow_steps()} engine steps over {STALL_LIMIT * 1000:.0f} ms; the server's {len(slow_steps)} "
              f"lines at info about them (first 20):")
        for line in slow_steps[:20]:
            print(f"- {line}")
    if args.concurrency == 1:  # one request at a time: each stall is the request's own
        stalling = sorted((o for o in report.outcomes if o.stall and o.stall > STALL_LIMIT), key=lambda o: -o.stall)
        print(f"\n{len(stalling)} requests held the loop over {STALL_LIMIT * 1000:.0f} ms (first 20):")
        for o in stalling[:20]:
            print(f"- stall <= {o.stall * 1000:.0f} ms, answered in {o.seconds:.2f} s {o.status}: "
                  f"{o.request.reproduction(160)}")
    slowest = sorted(report.outcomes, key=lambda o: -o.seconds)[:10]
    print("\nslowest answers:")
    for o in slowest:
        print(f"- {o.seconds:.2f} s {o.status}: {o.request.reproduction(160)}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
