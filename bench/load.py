"""Cold start: time from a new process to its first token, and peak memory while loading, for each
model of `wafer models`, wafer beside llama-cpp-python on the same GGUF file, in one run.

Each run is a fresh Python process that loads the model, prefills a short coding question in its
chat template (the same token ids for both) and produces one greedy token; the time is counted by
this script from just before the process starts to the moment the child has the token, so the
interpreter's and the libraries' start-up count too. The child reports its peak resident memory
(VmHWM) and its resident memory after the first token (VmRSS): the target is a peak at most 1.3x
that final size. wafer is measured twice: as `wafer serve` starts once `wafer models install`
has converted the file (records read from the cache), and converting the file's blocks in the run
(WAFER_RECORD_CACHE=off). Both use a 4096-token context and 2 threads; the file is in the page
cache (one warm-up run each), then the median of 3 runs, taken round-robin.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import table  # noqa: E402
from bench.llamacpp import build_path  # noqa: E402

QUESTION = "Write a Python function that returns the n-th Fibonacci number."
THREADS = 2


def _memory() -> dict[str, float]:
    status = Path("/proc/self/status").read_text()
    return {k: int(status.split(k + ":")[1].split()[0]) / 1024 for k in ("VmHWM", "VmRSS")}


def child_wafer(path: str, ids: list[int]) -> None:
    import torch

    torch.set_num_threads(THREADS)
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model

    loaded = load_model(path, compute="auto")
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=4096, prefix_caching=False))
    seq = engine.add(ids, SamplingParams(max_tokens=1, temperature=0))
    while not seq.output_ids:
        engine.step()
    print(json.dumps({"first": time.time(), "token": seq.output_ids[0], **_memory(), "compute": loaded.compute}))


def child_llama(path: str, ids: list[int]) -> None:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=4096, n_threads=THREADS, n_batch=512, verbose=False)
    for token in llm.generate(ids, temp=0.0, reset=True):
        break
    print(json.dumps({"first": time.time(), "token": int(token), **_memory()}))


def run(kind: str, path: str, ids: list[int], env: dict[str, str]) -> dict:
    start = time.time()
    done = subprocess.run([sys.executable, __file__, "--child", kind, path, json.dumps(ids)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} on {path} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["seconds"] = out["first"] - start
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "IDS"), help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--isa", default="native", help="llama.cpp build (bench/build_llama_cpp.py)")
    ap.add_argument("--models", nargs="*", help="names or tiers of `wafer models` (default: every installed one)")
    args = ap.parse_args()
    if args.child:
        kind, path, ids = args.child
        (child_wafer if kind.startswith("wafer") else child_llama)(path, json.loads(ids))
        return

    from wafer.kernels.build import features_line
    from wafer.models import catalog
    from wafer.models.chat_template import ChatTemplate
    from wafer.models.loader import load_tokenizer

    chosen = [catalog.find(n) for n in args.models] if args.models else list(catalog.CATALOG)
    base = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(THREADS))
    envs = {"wafer": base, "wafer (converting)": dict(base, WAFER_RECORD_CACHE="off"),
            "llama.cpp": dict(base, PYTHONPATH=os.pathsep.join([str(build_path(args.isa)), str(ROOT)]))}
    cpu = features_line()
    print(f"cold start to first token, {THREADS} threads; CPU: {cpu}; llama.cpp build: {args.isa}")
    rows = []
    for m in chosen:
        if m is None or catalog.installed_path(m) is None:
            print(f"skipped {m.name if m else '?'}: not installed (`wafer models install`)")
            continue
        path = str(catalog.installed_path(m))
        tok = load_tokenizer(path)
        template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
        ids = tok.encode(template.render([{"role": "user", "content": QUESTION}]), add_special_tokens=False)
        results: dict[str, list[dict]] = {k: [] for k in envs}
        for kind, env in envs.items():
            run(kind, path, ids, env)  # warm-up: the file (and the record cache) into the page cache
        for _ in range(args.repeats):
            for kind, env in envs.items():
                results[kind].append(run(kind, path, ids, env))
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("seconds", "VmHWM", "VmRSS")}
               for k, v in results.items()}
        llama_s = med["llama.cpp"]["seconds"]
        for kind in envs:
            r = med[kind]
            same = "same" if results[kind][0]["token"] == results["llama.cpp"][0]["token"] else "differs"
            rows.append([m.name, kind, f"{r['seconds']:.2f}", f"{r['seconds'] / llama_s:.2f}x",
                         f"{r['VmHWM']:.0f}", f"{r['VmRSS']:.0f}", f"{r['VmHWM'] / r['VmRSS']:.2f}x", same])
        print(table(["model", "system", "to first token s", "vs llama.cpp", "peak MB", "final MB", "peak/final",
                     "first token vs llama.cpp"], rows[-3:]), flush=True)
    print()
    print(table(["model", "system", "to first token s", "vs llama.cpp", "peak MB", "final MB", "peak/final",
                 "first token vs llama.cpp"], rows))
    print("targets: wafer's time at most 2x llama.cpp's; its peak at most 1.3x its final size")


if __name__ == "__main__":
    main()
