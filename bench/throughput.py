"""Aggregate decode throughput of wafer's engine with 1, 4, 16 and 64 concurrent sequences.

Each sequence gets a distinct short chat prompt and decodes --tokens tokens greedily with EOS
suppressed; prefill is excluded: the clock runs from the step where every sequence has its first
token to the end. In the same run, llama-cpp-python's single-stream decode (bench/decode.py's
measurement, median of 3) is the baseline of the last columns: the issue asks 16 sequences for 8x it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import PROMPT, table  # noqa: E402
from bench.llamacpp import LlamaCpp, available  # noqa: E402
from wafer.engine.config import EngineConfig  # noqa: E402
from wafer.engine.engine import LLMEngine  # noqa: E402
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
    ap.add_argument("--quant", default="f32,int8,q8,q4")
    args = ap.parse_args()
    torch.set_num_threads(2)
    levels = [int(x) for x in args.concurrency.split(",")]
    baseline = None
    if available("native"):
        lc = LlamaCpp("native", n_ctx=2048)
        loaded = load_model(compute="f32")
        ids = loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": PROMPT}]),
                                      add_special_tokens=False)
        lc.generate(ids, 8, stop_at_eos=False)  # warm-up
        rates = []
        for _ in range(3):
            r = lc.generate(ids, 256, stop_at_eos=False)
            rates.append((len(r["tokens"]) - 1) / r["after_first"])
        baseline = statistics.median(rates)
        lc.close()
    rows = []
    for path in args.quant.split(","):
        loaded = load_model(compute=path)
        run(loaded, 1, 4)  # warm-up
        results = [run(loaded, n, args.tokens) for n in levels]
        row = [path, *[f"{r:.1f}" for r in results], f"{results[-1] / results[0]:.1f}x"]
        if baseline is not None:
            row += [f"{results[levels.index(n)] / baseline:.1f}x" for n in levels if n >= 16]
        rows.append(row)
    print(f"Aggregate decode tokens/s, default model, {args.tokens} new tokens per sequence")
    headers = ["compute path", *[f"{n} seq" for n in levels], f"{levels[-1]} vs 1"]
    if baseline is not None:
        print(f"llama-cpp-python single stream, same run: {baseline:.1f} tokens/s (median of 3, 256 tokens)")
        headers += [f"{n} seq vs llama-cpp-python 1" for n in levels if n >= 16]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
