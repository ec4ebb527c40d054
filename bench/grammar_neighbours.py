"""Neighbour streams beside a request whose schema is costly to follow, against a real `wafer serve`
(default model) on loopback.

For each schema: `--streams` streamed chat requests of `--tokens` tokens each (ignore_eos), first
alone, then while a request with that schema (tool_choice "required", sent again as soon as it ends)
runs beside them; the alternation `--rounds` times. Prints, per schema, the neighbours' mean time
per token alone and beside it and their ratio (the acceptance: at most 1.5), the server process's
CPU time per neighbour token alone and beside it and their ratio (what the neighbours wait for on a
machine with cores to spare; on a shared one, wall time mostly measures the other jobs), how the
costly requests ended (HTTP status and error code), and the engine steps whose grammar work took
over 100 ms of wall time (wafer:grammar_mask_seconds on /metrics). Exits 1 if a ratio of time per
token is over the limit.

The schemas: a recursive `$ref` that every branch requires (refused up front with a 400); a
recursive one that no up-front check sees (`minProperties` over a recursive pattern property:
llguidance's limits or the request's grammar budget end it at run time); and a recursive one that
can stop (a tree whose children may be none), which is served.

The machine is whatever runs this: on one shared with other jobs the figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.common import PROMPT, table  # noqa: E402
from bench.served import start  # noqa: E402

LOG = Path(__file__).resolve().parent / "out" / "grammar-neighbours-server.log"
MODEL = "SmolLM2-135M-Instruct"
LIMIT = 1.5
SCHEMAS = {
    "recursive required $ref": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "recursive minProperties": {"type": "object", "patternProperties": {"^a$": {"$ref": "#"}}, "minProperties": 1,
                                "additionalProperties": False},
    "tree (can stop)": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                                         "name": {"type": "string"}}, "required": ["kids"]},
}


async def neighbour(client: httpx.AsyncClient, tokens: int) -> float:
    """Seconds per token of one streamed reply, from its first token to its last."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stamps = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


async def costly(client: httpx.AsyncClient, schema: dict, stop: asyncio.Event, ends: Counter) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}], "max_tokens": 400,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "tool_choice": "required", "temperature": 0.8}
    while not stop.is_set():
        r = await client.post("/v1/chat/completions", json=body)
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else r.json()["choices"][0]["finish_reason"]
        ends[f"{r.status_code} {code}"] += 1


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def round_(base: str, streams: int, tokens: int, schema: dict | None, ends: Counter) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        stop = asyncio.Event()
        bad = asyncio.create_task(costly(client, schema, stop, ends)) if schema is not None else None
        if bad is not None:
            await asyncio.sleep(0.5)  # under way before the neighbours start
        per_token = await asyncio.gather(*(neighbour(client, tokens) for _ in range(streams)))
        stop.set()
        if bad is not None:
            await bad
    return sum(per_token) / len(per_token)


def slow_grammar_steps(root: str) -> tuple[int, int]:
    """(steps with grammar work, of which over 100 ms) from wafer:grammar_mask_seconds."""
    total = under = 0
    for family in text_string_to_metric_families(httpx.get(root + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "wafer:grammar_mask_seconds_count":
                total += int(s.value)
            if s.name == "wafer:grammar_mask_seconds_bucket" and s.labels["le"] == "0.1":
                under += int(s.value)
    return total, total - under


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--schema", action="append", choices=list(SCHEMAS), help="default: each")
    args = ap.parse_args()
    server = start([MODEL], LOG)
    rows, ok = [], True
    try:
        base = server.root
        asyncio.run(round_(base, args.streams, 8, None, Counter()))  # warm-up
        for name in args.schema or list(SCHEMAS):
            alone, beside, ends = [], [], Counter()
            cpu = {"alone": 0.0, "beside": 0.0}
            before = slow_grammar_steps(base)
            for _ in range(args.rounds):
                for kind, schema, times in (("alone", None, alone), ("beside", SCHEMAS[name], beside)):
                    used = cpu_seconds(server.proc.pid)
                    times.append(asyncio.run(round_(base, args.streams, args.tokens, schema, ends)))
                    cpu[kind] += cpu_seconds(server.proc.pid) - used
            after = slow_grammar_steps(base)
            a, b = sum(alone) / len(alone), sum(beside) / len(beside)
            tokens = args.rounds * args.streams * args.tokens
            ca, cb = cpu["alone"] / tokens, cpu["beside"] / tokens
            ok &= b / a <= LIMIT
            rows.append([name, f"{a * 1000:.1f}", f"{b * 1000:.1f}", f"{b / a:.2f}", f"{ca * 1000:.1f}",
                         f"{cb * 1000:.1f}", f"{cb / ca:.2f}", json.dumps(dict(ends)),
                         f"{after[1] - before[1]} of {after[0] - before[0]}"])
    finally:
        server.stop()
    print(f"{args.streams} neighbour streams of {args.tokens} tokens, {args.rounds} rounds alone and beside; "
          f"limit {LIMIT}x")
    print(table(["costly schema", "ms/token alone", "ms/token beside", "ratio", "CPU ms/token alone",
                 "CPU ms/token beside", "CPU ratio", "costly requests ended", "grammar steps > 100 ms"], rows))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
