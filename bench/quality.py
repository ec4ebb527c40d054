"""Perplexity of each wafer compute path against the float32 reference, on the same text.

The text is English prose that ships with Python (pydoc_data.topics), cut into windows of
--window tokens; every token after the first of a window is scored. Speed must never be bought with
silent quality loss: the last column is each path's perplexity relative to float32.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import table  # noqa: E402
from wafer.engine.kv_cache import KVCache  # noqa: E402
from wafer.engine.model_runner import ModelRunner  # noqa: E402
from wafer.engine.scheduler import ScheduledSeq  # noqa: E402
from wafer.engine.sequence import SamplingParams, Sequence  # noqa: E402
from wafer.models.loader import load_model  # noqa: E402
from wafer.models.quant import CPU_PATHS  # noqa: E402


def corpus_ids(tokenizer, n_tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode(text, add_special_tokens=False)[:n_tokens]


def perplexity(loaded, ids: list[int], window: int, step: int, kv_dtype: torch.dtype | None = None) -> float:
    """Each window is fed `step` tokens per forward pass, so the kernels measured are those that run
    batches of that many rows (decode-sized steps by default, not the prefill path). `kv_dtype`: the
    KV cache's (default: the model's activation dtype)."""
    kv = KVCache(loaded.config, 1, window, dtype=kv_dtype or loaded.model.norm.weight.dtype)
    runner = ModelRunner(loaded.model, kv)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        seq = Sequence(chunk, SamplingParams())
        seq.slot = 0
        logits = torch.cat([runner.run([ScheduledSeq(seq, s, min(step, len(chunk) - s))], all_logits=True)
                            for s in range(0, len(chunk), step)])
        lp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(lp.gather(1, target.view(-1, 1)).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--model", default=None)
    ap.add_argument("--step", type=int, default=8, help="tokens per forward pass (8: the decode-batch kernels)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows, ref = [], None
    for path in CPU_PATHS:
        loaded = load_model(args.model, compute=path)
        ids = corpus_ids(loaded.tokenizer, args.tokens)
        t0 = time.perf_counter()
        ppl = perplexity(loaded, ids, args.window, args.step)
        secs = time.perf_counter() - t0
        ref = ref or ppl
        # What really ran: the resolved path and its kernels (a q4 that fell back says int8 here).
        rows.append([path, loaded.compute, loaded.kernels, f"{len(ids)}", f"{ppl:.4f}", f"{ppl / ref:.4f}",
                     f"{len(ids) / secs:.0f}"])
        del loaded
    print(f"Perplexity on pydoc_data.topics, windows of {args.window} tokens, {args.step} tokens per forward pass")
    print(table(["asked", "ran", "kernels", "tokens", "perplexity", "vs f32", "scored tok/s"], rows))


if __name__ == "__main__":
    main()
