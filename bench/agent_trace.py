"""Agent traces: recorded multi-turn agent conversations replayed through /v1/chat/completions,
plain and with each kind of speculation, side by side.

The traces (bench/traces/TIER.json) are written by the tiers themselves: `--record` walks three
scripted agent sessions against a plain, greedy `wafer serve` of each tier, the harness's actions
(tool calls as JSON, their results) fixed and the model's turns its own, and keeps every request
with the model's greedy output. The sessions:
- edit: a coding agent reads inventory.py (a tool call), rewrites it whole with a name changed, runs
  the tests (a tool call), rewrites it to fix what failed, then once more with docstrings;
- json: the agent reads a JSON config through a tool and writes it back with a few fields changed;
- ultra: three sub-agents each review one function (their own text), then a synthesis that sets
  their findings out verbatim, under a heading each, as Ultra's synthesis copies its sub-agents'.
The model turns are asked for with the tools in the request and `tool_choice: "none"` (the harness
writes the file from the reply); a reply that is a tool call would run under its JSON grammar,
drafted too (drafts cut to what the grammar accepts, each verified token masked).

Replay: for each tier and method (plain, ngram, draft (sol, drafted by terra), suffix, all (ngram,
suffix and, for sol, the draft), the engine picking per sequence and step) a server is started and
the trace's requests sent at 1, 4 and 16 streams (the turns in order, shared among that many
concurrent clients; at least as many requests as streams). Greedy output must equal the plain
pass's at the same streams (speculation is lossless) and the recorded one, and the script says
where it did not. Servers run with `--prefill-step-ms 0`, when recording too: prompt chunks then do
not depend on the machine's load, nor the replies on the chunks. Each pass sends its own
`prompt_cache_key`, so suffix drafts draw on that pass's earlier outputs and no other's.

Printed per tier, method and streams: tokens/s per stream (completion tokens over the request's
seconds, summed over the requests), aggregate tokens/s (all completion tokens over the pass's wall
time), tokens kept per drafted step, the share of decoding steps that drafted (from /metrics), and
the ratios of both speeds to plain at the same streams.

    python bench/agent_trace.py --record [--tiers luna,terra,sol]
    python bench/agent_trace.py [--tiers luna] [--quick] [--streams 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.common import table  # noqa: E402
from bench.served import Server, start  # noqa: E402

TRACES = Path(__file__).with_name("traces")
TIERS = ("luna", "terra", "sol")
QUICK = ("edit/rename", "edit/fix", "json/disable", "ultra/synthesis")
K = 16  # the most tokens proposed a step, for every method (adaptive lengths choose below it)

INVENTORY = '''\
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    qty: int
    price: float


def total(items: list[Item]) -> float:
    return int(sum(item.qty * item.price for item in items))


def restock(items: list[Item], name: str, qty: int) -> None:
    for item in items:
        if item.name == name:
            item.qty += qty
            return
    items.append(Item(name, qty, 0.0))


def low_stock(items: list[Item], limit: int = 5) -> list[str]:
    return [item.name for item in items if item.qty < limit]
'''

TEST_FAIL = '''\
============================= test session starts ==============================
collected 3 items

test_inventory.py::test_total FAILED
test_inventory.py::test_restock PASSED
test_inventory.py::test_low_stock PASSED

=================================== FAILURES ===================================
__________________________________ test_total __________________________________
    def test_total():
        items = [Item("bolt", quantity=5, price=0.5), Item("nut", quantity=10, price=1.0)]
>       assert total(items) == 12.5
E       assert 12 == 12.5
E        +  where 12 = total([Item(name='bolt', quantity=5, price=0.5), Item(name='nut', quantity=10, price=1.0)])
test_inventory.py:8: AssertionError
=========================== short test summary info ============================
FAILED test_inventory.py::test_total - assert 12 == 12.5
========================= 1 failed, 2 passed in 0.02s ==========================
'''

TEST_PASS = '''\
============================= test session starts ==============================
collected 3 items

test_inventory.py::test_total PASSED
test_inventory.py::test_restock PASSED
test_inventory.py::test_low_stock PASSED

============================== 3 passed in 0.02s ===============================
'''

CONFIG = {"services": [{"name": f"svc-{i}", "region": ("eu" if i % 3 == 0 else "us"), "enabled": True,
                        "replicas": 1 + i % 4, "port": 8000 + i} for i in range(8)]}


def _tool(name: str, description: str, props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}


TOOLS = [
    _tool("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
    _tool("write_file", "Write a file of the repository.", {"path": {"type": "string"}, "content": {"type": "string"}}),
    _tool("run_tests", "Run the test suite and return its output.", {"path": {"type": "string"}}),
    _tool("spawn_agent", "Give a task to a sub-agent and return its report.", {"task": {"type": "string"}}),
]
SYSTEM = ("You are a coding agent working in a repository through tools. To change a file, reply with the whole "
          "new file in one ```python block (or ```json for JSON) and nothing else; the harness writes it.")


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _assistant(content: str | None, calls: list[dict]) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _result(i: int, content: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": content}


@dataclass
class Session:
    """One scripted session: the harness's messages, the model's turns in between."""

    name: str
    turns: list[dict] = field(default_factory=list)  # each: id, messages, max_tokens, output


def record_sessions(ask) -> list[dict]:  # type: ignore[no-untyped-def]
    """Walk the three sessions; `ask(messages, max_tokens)` gives the model's greedy reply."""
    turns: list[dict] = []

    def turn(tid: str, messages: list[dict], max_tokens: int) -> str:
        out = ask(messages, max_tokens)
        turns.append({"id": tid, "messages": json.loads(json.dumps(messages)), "max_tokens": max_tokens,
                      "output": out})
        return out

    # edit: read, rewrite with a rename, test, fix, test, docstrings.
    m = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "In inventory.py, rename the field `qty` to `quantity` everywhere, then make "
                                     "the tests pass."},
         _assistant(None, [_call(1, "read_file", {"path": "inventory.py"})]), _result(1, INVENTORY)]
    a = turn("edit/rename", m, 320)
    m += [_assistant(a, [_call(2, "run_tests", {"path": "test_inventory.py"})]), _result(2, TEST_FAIL)]
    b = turn("edit/fix", m, 320)
    m += [_assistant(b, [_call(3, "run_tests", {"path": "test_inventory.py"})]), _result(3, TEST_PASS),
          {"role": "user", "content": "Good. Now add a one-line docstring to each function, keeping the code as "
                                      "it is."}]
    turn("edit/docstrings", m, 384)
    # json: read a config, write it back changed.
    m = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "In deploy.json, disable every service of region eu (enabled: false) and "
                                     "leave the rest as it is."},
         _assistant(None, [_call(4, "read_file", {"path": "deploy.json"})]),
         _result(4, json.dumps(CONFIG, indent=2))]
    turn("json/disable", m, 384)
    # ultra: sub-agents review a function each, then the synthesis copies their reports.
    reports = []
    for i, fn in enumerate(("total", "restock", "low_stock")):
        src = INVENTORY[INVENTORY.index(f"def {fn}("):].split("\n\n\n")[0]
        sub = [{"role": "user", "content": f"Review this function of inventory.py and list two possible problems "
                                           f"as short bullet points.\n```python\n{src}\n```"}]
        reports.append(turn(f"ultra/review_{fn}", sub, 96))
    m = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "Review inventory.py with one sub-agent per function, then report."},
         _assistant(None, [_call(10 + i, "spawn_agent", {"task": f"Review {fn}"})
                           for i, fn in enumerate(("total", "restock", "low_stock"))]),
         *[_result(10 + i, r) for i, r in enumerate(reports)],
         {"role": "user", "content": "Write the final report: for each function a heading `## NAME`, then its "
                                     "sub-agent's findings copied verbatim, then one line of summary at the end."}]
    turn("ultra/synthesis", m, 384)
    return turns


def model_args(tier: str) -> list[str]:
    from wafer.models import catalog

    m = catalog.find(tier)
    path = catalog.installed_path(m) if m is not None else None
    if path is None:
        raise SystemExit(f"tier {tier} is not installed (wafer models install)")
    return [str(path), "--served-model-name", tier]


def methods(tier: str) -> dict[str, list[str]]:
    """The server flags of each method; `draft` only where a smaller tier drafts (sol, by terra)."""
    out = {"plain": [], "ngram": ["--speculative", "ngram"], "suffix": ["--speculative", "suffix"]}
    draft = None
    if tier == "sol":
        draft = model_args("terra")[0]
        out["draft"] = ["--speculative", f"draft:{draft}"]
    out["all"] = ["--speculative", "auto" + (f",draft:{draft}" if draft else "")]
    return {name: (flags + ["--num-speculative-tokens", str(K)] if flags else flags) for name, flags in out.items()}


def serve(tier: str, flags: list[str]) -> Server:
    # Prompt chunks bounded by --max-batched-tokens alone, not by what a token took to compute: where
    # the time decides them, a reply depends on the machine's load (another chunking computes the
    # same KV to within rounding, which tips greedy choices at near ties), and a replay could not
    # be held to the recording, nor a method to plain decoding.
    return start([*model_args(tier), "--max-running", "16", "--prefill-step-ms", "0", *flags],
                 Path(f"bench/out/agent_trace_{tier}.log"))


def client(server: Server):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=1800)


def request(server: Server, tier: str, turn: dict, key: str | None = None, cap: int | None = None
            ) -> tuple[str, int, float]:
    """The reply's text, its completion tokens and the request's seconds; `cap`: at most that many tokens."""
    started = time.perf_counter()
    r = client(server).chat.completions.create(
        model=tier, messages=turn["messages"], tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=min(turn["max_tokens"], cap or turn["max_tokens"]),
        **({"extra_body": {"prompt_cache_key": key}} if key else {}))
    return r.choices[0].message.content or "", r.usage.completion_tokens, time.perf_counter() - started


def record(tier: str) -> None:
    server = serve(tier, [])
    try:
        turns = record_sessions(lambda messages, n: request(server, tier, {"messages": messages, "max_tokens": n})[0])
    finally:
        server.stop()
    TRACES.mkdir(exist_ok=True)
    path = TRACES / f"{tier}.json"
    path.write_text(json.dumps({"tier": tier, "tools": TOOLS, "turns": turns}, indent=1) + "\n")
    print(f"{path}: {len(turns)} turns, {sum(len(t['output']) for t in turns)} characters of output")


def counters(server: Server) -> dict[str, float]:
    want = {"wafer:spec_decode_num_drafts": "drafts", "wafer:spec_decode_num_accepted_tokens": "accepted",
            "wafer:spec_decode_num_steps": "steps"}
    out = dict.fromkeys(want.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(server.root + "/metrics", timeout=30).text):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if name in want and s.name.endswith("_total"):
                out[want[name]] += s.value
    return out


@dataclass
class Pass:
    tokens: int
    seconds: float  # summed over the requests
    wall: float
    drafts: float
    accepted: float
    steps: float
    mismatches: list[str]  # turns whose reply is not the recorded one
    texts: list[str] = field(default_factory=list)  # the replies, in the order sent

    @property
    def per_stream(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def aggregate(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


def replay(server: Server, tier: str, turns: list[dict], streams: int, key: str, cap: int | None) -> Pass:
    n = max(len(turns), streams)
    queue = [turns[i % len(turns)] for i in range(n)]
    before = counters(server)
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda t: request(server, tier, t, key, cap), queue))
    wall = time.perf_counter() - started
    after = counters(server)
    # Greedy: the reply is the recorded one (its beginning, where `cap` cut it short).
    bad = sorted({t["id"] for t, (text, _, _) in zip(queue, results)
                  if text != t["output"] and not (cap and t["output"].startswith(text))})
    return Pass(sum(r[1] for r in results), sum(r[2] for r in results), wall,
                after["drafts"] - before["drafts"], after["accepted"] - before["accepted"],
                after["steps"] - before["steps"], bad, [r[0] for r in results])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="write bench/traces/TIER.json with the tiers themselves")
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--methods", default=None, help="of plain,ngram,draft,suffix,all (default: all that apply)")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=None, help="cut every reply to this many tokens")
    ap.add_argument("--quick", action="store_true",
                    help="luna alone, four turns (the rename, the fix, the JSON, the synthesis), 128 tokens each")
    args = ap.parse_args()
    tiers = ["luna"] if args.quick else [t.strip() for t in args.tiers.split(",") if t.strip()]
    if args.record:
        for tier in tiers:
            record(tier)
        return
    streams = [int(s) for s in args.streams.split(",")]
    print(f"agent traces, greedy, K={K} (adaptive lengths), --max-running 16; streams {streams}", flush=True)
    for tier in tiers:
        trace = json.loads((TRACES / f"{tier}.json").read_text())
        turns = trace["turns"]
        cap = args.max_tokens
        if args.quick:
            turns = [t for t in turns if t["id"] in QUICK]
            cap = cap or 128
        chosen = methods(tier)
        if args.methods:
            chosen = {k: v for k, v in chosen.items() if k in args.methods.split(",") or k == "plain"}
        results: dict[tuple[str, int], Pass] = {}
        for method, flags in chosen.items():
            server = serve(tier, flags)
            try:
                request(server, tier, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "warm")
                for s in streams:
                    p = results[(method, s)] = replay(server, tier, turns, s, f"{method}-{s}", cap)
                    print(f"  {tier} {method} x{s}: {p.tokens} tokens, {p.per_stream:.1f} tok/s/stream, "
                          f"{p.aggregate:.1f} aggregate, {int(p.accepted)} kept in {int(p.drafts)} drafts, "
                          f"{int(p.steps)} steps, replies as recorded: {not p.mismatches}", flush=True)
            finally:
                server.stop()
        rows = []
        queue = {s: [turns[i % len(turns)]["id"] for i in range(max(len(turns), s))] for s in streams}
        for (method, s), p in results.items():
            base = results[("plain", s)]
            # Lossless: each reply the plain pass's at the same streams (the recording aside).
            unlike = sorted({tid for tid, a, b in zip(queue[s], p.texts, base.texts) if a != b})
            rows.append([method, str(s), f"{p.per_stream:.1f}", f"{p.per_stream / base.per_stream:.2f}x",
                         f"{p.aggregate:.1f}", f"{p.aggregate / base.aggregate:.2f}x",
                         f"{p.accepted / p.drafts:.2f}" if p.drafts else "-",
                         f"{100 * p.drafts / p.steps:.0f}%" if p.steps else "-",
                         "yes" if not unlike else "NO: " + ", ".join(unlike),
                         "yes" if not p.mismatches else "NO: " + ", ".join(p.mismatches)])
        print(f"\n{tier}: {len(turns)} turns, {sum(len(t['output']) for t in turns)} characters of recorded output"
              + (f", replies cut to {cap} tokens" if cap else ""))
        print(table(["method", "streams", "tok/s/stream", "vs plain", "aggregate tok/s", "vs plain",
                     "kept/drafted step", "steps drafted", "= plain", "= recorded"], rows), flush=True)


if __name__ == "__main__":
    main()
