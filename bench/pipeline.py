"""Pipeline stages (engine/pipeline/) against one process, side by side in one run.

For 1, 2 and 3 stages, each in a fresh process (so that memory figures are its own): S streams
(1, 4, 16) of the same chat prompt decode --tokens tokens each, greedy, ignoring end of sequence,
after a warm-up. Aggregate decode tokens/s (from the step that gave every stream its first token to
the last), its ratio to one process at the same number of streams, the resident memory of each
stage process after the run, the weights each stage holds, and the time a token spends in rank 0's
sends and receives between stages (waits for the other stages excluded).

The machine's threads are shared among the stages: with T threads, one process computes on T, and
each of N stages on T // N (at least 1, so 3 stages on 2 cores run 3 threads).

    python bench/pipeline.py [--model PATH] [--tokens 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PROMPT, table  # noqa: E402

STREAMS = (1, 4, 16)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model: str | None, stages: int, tokens: int) -> dict:
    import torch

    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model
    from wafer.models.stage import layer_costs

    loaded = load_model(model, compute="auto")
    costs, head = layer_costs(loaded.model)  # type: ignore[arg-type]
    engine = LLMEngine(loaded, EngineConfig(max_running=16, pipeline_parallel=stages))
    ids = loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": PROMPT}],
                                                              add_generation_prompt=True))
    engine.generate([ids], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    out: dict = {"threads": torch.get_num_threads(), "runs": {}}
    for streams in STREAMS:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        seqs = [engine.add(list(ids), params) for _ in range(streams)]
        start = None
        pipe = engine.pipeline
        before = (pipe.transfer_seconds, pipe.bytes_sent + pipe.bytes_received) if pipe else (0.0, 0)
        while engine.has_work or engine.executor.in_flight:
            engine.step()
            if start is None and all(len(s.tokens) > s.num_prompt for s in seqs):
                start, first = time.perf_counter(), sum(len(s.tokens) - s.num_prompt for s in seqs)
        seconds = time.perf_counter() - start  # type: ignore[operator]
        generated = sum(len(s.tokens) - s.num_prompt for s in seqs) - first
        transfer, moved = ((pipe.transfer_seconds - before[0], pipe.bytes_sent + pipe.bytes_received - before[1])
                           if pipe else (0.0, 0))
        total = generated + first
        out["runs"][streams] = {"tok_s": generated / seconds, "transfer_ms_per_token": 1000 * transfer / total,
                                "kb_per_token": moved / 1024 / total}
    pids = [os.getpid()] + (engine.pipeline.stage_pids() if engine.pipeline else [])
    out["rss_mb"] = [rss_mb(p) for p in pids]
    ranges = engine.pipeline.spec.ranges if engine.pipeline else [(0, len(costs))]
    out["weights_mb"] = [(sum(costs[a:b]) + (head if b == len(costs) else 0)) / 2**20 for a, b in ranges]
    out["ranges"] = ranges
    engine.close()
    return out


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of the three configurations, interleaved; each figure is the median of its rounds "
                        "(this host's speed drifts by 2x within minutes)")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.tokens)))
        return
    rounds: dict[int, list[dict]] = {1: [], 2: [], 3: []}
    for _ in range(args.repeat):
        for stages in rounds:
            cmd = [sys.executable, __file__, "--child", str(stages), "--tokens", str(args.tokens)]
            if args.model:
                cmd += ["--model", args.model]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rounds[stages].append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = {}
    for stages, rs in rounds.items():
        results[stages] = dict(rs[-1])
        results[stages]["runs"] = {k: {m: statistics.median(r["runs"][k][m] for r in rs) for m in rs[0]["runs"][k]}
                                   for k in rs[0]["runs"]}
    print(f"{cpu()}, {os.cpu_count()} cores; {args.model or 'SmolLM2-135M-Instruct (default path)'}, "
          f"{args.tokens} tokens a stream, greedy; medians of {args.repeat} interleaved rounds\n")
    rows = []
    for stages, r in results.items():
        for streams in STREAMS:
            run = r["runs"][str(streams)]
            base = results[1]["runs"][str(streams)]["tok_s"]
            rows.append([str(stages), str(streams), f"{run['tok_s']:.1f}", f"{run['tok_s'] / base:.2f}x",
                         f"{run['transfer_ms_per_token']:.3f}", f"{run['kb_per_token']:.0f}"])
    print("Aggregate decode tokens/s (the machine's threads shared among the stages). Transfer: a step's time from its")
    print("send by rank 0 to its logits back, less the other stages' compute on it (with several steps in flight, waiting")
    print("behind another counts in), per token; KB: bytes between stages per token (hidden states, step, logits)")
    print(table(["stages", "streams", "tokens/s", "vs 1 stage", "transfer ms/token", "KB/token"], rows))
    print("\nMemory of each stage process after the run (rank 0 also holds the tokenizer, scheduler and sampler)")
    rows = [[str(stages), ", ".join(f"{a}-{b - 1}" for a, b in r["ranges"]),
             ", ".join(f"{w:.0f}" for w in r["weights_mb"]), ", ".join(f"{m:.0f}" for m in r["rss_mb"]),
             str(r["threads"])] for stages, r in results.items()]
    print(table(["stages", "layers per stage", "weights MB per stage", "RSS MB per stage", "threads each"], rows))
    ratio = results[2]["runs"]["16"]["tok_s"] / results[1]["runs"]["16"]["tok_s"]
    print(f"\n{'PASS' if ratio >= 0.8 else 'FAIL'}  2 stages at 16 streams: {ratio:.2f}x one process (target >= 0.8x)")


if __name__ == "__main__":
    main()
