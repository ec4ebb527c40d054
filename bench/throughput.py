"""Aggregate decode throughput of wafer's engine with 1, 4, 16 and 64 concurrent sequences.

Each sequence gets a distinct short chat prompt and decodes --tokens tokens greedily with EOS
suppressed; prefill is excluded: the clock runs from the step where every sequence has its first
token to the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import table  # noqa: E402
from wafer.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from wafer.engine.sequence import SamplingParams  # noqa: E402
from wafer.models.loader import load_model  # noqa: E402


def run(loaded, n: int, tokens: int) -> float:
    engine = LLMEngine(loaded, EngineConfig(max_running=n, max_model_len=512, max_batched_tokens=4096))
    tok = loaded.tokenizer
    prompts = [tok.encode(loaded.chat_template.render([{"role": "user", "content": f"Tell story number {i}."}]),
                          add_special_tokens=False) for i in range(n)]
    params = SamplingParams(max_tokens=tokens, temperature=0, logit_bias={e: -1e9 for e in tok.eos_ids})
    seqs = [engine.add(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    start_tokens = sum(len(s.output_ids) for s in seqs)
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    secs = time.perf_counter() - t0
    return (sum(len(s.output_ids) for s in seqs) - start_tokens) / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--quant", default="f32,int8,q4")
    args = ap.parse_args()
    torch.set_num_threads(2)
    levels = [int(x) for x in args.concurrency.split(",")]
    rows = []
    for path in args.quant.split(","):
        loaded = load_model(compute=path)
        run(loaded, 1, 4)  # warm-up
        results = [run(loaded, n, args.tokens) for n in levels]
        rows.append([path, *[f"{r:.1f}" for r in results], f"{results[-1] / results[0]:.1f}x"])
    print(f"Aggregate decode tokens/s, default model, {args.tokens} new tokens per sequence")
    print(table(["compute path", *[f"{n} seq" for n in levels], f"{levels[-1]} vs 1"], rows))


if __name__ == "__main__":
    main()
