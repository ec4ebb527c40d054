"""Replicas behind the router (router/replicas.py), side by side in one run.

1. Throughput: `wafer serve` of the default model as one replica, then as two, each behind a router
   (`wafer serve --config`, an upstream of `replicas`, least outstanding); S streams (16, 32, 64)
   each send chat requests of --tokens tokens until S x --rounds are answered. Output tokens/s through
   the router, and the ratio of two replicas to one. The replicas share the machine's cores: with
   two, each gets half of them (OMP_NUM_THREADS), so that both runs use the same threads in all.
2. Multi-turn: C conversations of T turns at once through two replicas, each turn sending the whole
   history (as a chat client does), streamed: the prefix policy against least outstanding. The share
   of prompt tokens served from the replicas' prefix caches, and TTFT (p50, p95) per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.common import table  # noqa: E402
from bench.served import start  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
OUT = Path(__file__).resolve().parent / "out"


def router_config(path: Path, urls: list[str]) -> Path:
    """A router over the replicas: one upstream per policy (the tiny local model is only there because
    a wafer server serves at least one; no request goes to it)."""
    reps = ", ".join(f'"{u}"' for u in urls)
    path.write_text(f"""
[models.local]
path = "bundled"
max_running = 1
max_model_len = 256

[upstreams.balanced]
replicas = [{reps}]
model = "{MODEL}"

[upstreams.affine]
replicas = [{reps}]
model = "{MODEL}"
policy = "prefix"
""")
    return path


async def throughput(base: str, streams: int, rounds: int, tokens: int) -> tuple[float, int]:
    """Output tokens/s through the router with `streams` clients, each sending `rounds` requests."""
    done = 0

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal done
        for r in range(rounds):
            resp = await http.post(base + "/chat/completions", json={
                "model": "balanced", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Tell story number {i}-{r}."}]})
            resp.raise_for_status()
            done += resp.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(streams)))
        return done / (time.perf_counter() - t0), done


async def conversations(base: str, model: str, count: int, turns: int, tokens: int, seed: int) -> dict[str, float]:
    """`count` chats of `turns` turns at once: prefix hit rate and TTFTs (streamed, first content)."""
    ttfts: list[float] = []
    prompt = cached = 0

    async def chat(i: int, http: httpx.AsyncClient) -> None:
        nonlocal prompt, cached
        messages = [{"role": "system", "content": f"You are assistant {seed}-{i}. Keep answers short and exact."},
                    {"role": "user", "content": f"Conversation {seed}-{i}: name a country in Europe."}]
        for turn in range(turns):
            t0 = time.perf_counter()
            first, text, usage = None, "", {}
            async with http.stream("POST", base + "/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    for ch in event.get("choices") or []:
                        piece = ch.get("delta", {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            text += piece
            ttfts.append((first or time.perf_counter()) - t0)
            prompt += usage.get("prompt_tokens", 0)
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Now name its capital, then another country (turn {turn + 2})."}]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=count + 4)) as http:
        await asyncio.gather(*(chat(i, http) for i in range(count)))
    q = statistics.quantiles(ttfts, n=20)
    return {"hit": cached / max(prompt, 1), "p50": statistics.median(ttfts), "p95": q[18], "prompt": prompt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream in the throughput runs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"{cpu}, {cores} cores; {MODEL}, {args.tokens} tokens a request")
    rows, by_count = [], {}
    servers = []
    try:
        for n in (1, 2):
            threads = str(max(1, cores // n))
            reps = [start([MODEL, "--max-running", "64", "--max-waiting", "256"], OUT / f"replica-{n}-{i}.log",
                          env={"OMP_NUM_THREADS": threads}) for i in range(n)]
            servers += reps
            cfg = router_config(OUT / f"replicas-{n}.toml", [r.base_url for r in reps])
            router = start(["--config", str(cfg)], OUT / f"router-{n}.log")
            servers.append(router)
            for s in args.streams:
                rate, _ = asyncio.run(throughput(router.base_url, s, args.rounds, args.tokens))
                by_count[(n, s)] = rate
            if n == 2:
                policy_rows = []
                for seed, model in enumerate(("balanced", "affine")):
                    r = asyncio.run(conversations(router.base_url, model, args.conversations, args.turns, 24, seed))
                    policy_rows.append([{"balanced": "least outstanding", "affine": "prefix"}[model],
                                        f"{r['hit']:.3f}", f"{r['p50'] * 1000:.0f}", f"{r['p95'] * 1000:.0f}",
                                        str(r["prompt"])])
            for srv in [*reps, router]:
                srv.stop()
            servers = []
        for s in args.streams:
            one, two = by_count[(1, s)], by_count[(2, s)]
            rows.append([str(s), f"{one:.1f}", f"{two:.1f}", f"{two / one:.2f}x"])
        print("\nOutput tokens/s through the router (one replica with every core; two with half each)")
        print(table(["streams", "1 replica", "2 replicas", "ratio"], rows))
        print(f"\nMulti-turn: {args.conversations} conversations x {args.turns} turns at once, two replicas")
        print(table(["policy", "prefix hit rate", "TTFT p50 ms", "TTFT p95 ms", "prompt tokens"], policy_rows))
    finally:
        for srv in servers:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
