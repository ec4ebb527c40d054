"""llama-cpp-python, the benches' baseline, run in a subprocess of its own.

Each build of bench/build_llama_cpp.py (`native`: every instruction set of this CPU; `avx2`: AVX2,
FMA and F16C only) lives in its own folder, and a bench can compare wafer with either in one run:
the subprocess puts the chosen build first on its path. It also keeps llama.cpp's OpenMP threads
apart from PyTorch's. The bench talks to it in JSON lines over a pipe: a prompt's ids and a token
count in, timings and tokens out (the pipe's cost falls outside the timed spans, which the worker
takes itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_path(isa: str) -> Path:
    return ROOT / ".venv" / "llama-cpp" / isa


class LlamaCpp:
    """A llama.cpp worker on the bundled GGUF (or `model`), with `threads` threads."""

    def __init__(self, isa: str = "native", n_ctx: int = 4096, threads: int = 2, model: str | None = None) -> None:
        from wafer.models.loader import default_model_path

        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(build_path(isa)), str(ROOT)]))
        self.isa = isa
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(model or default_model_path()), str(n_ctx), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        hello = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        self.system_info: str = hello["system_info"]

    def _ask(self, **req: object) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def generate(self, ids: list[int], n: int, stop_at_eos: bool = True) -> dict:
        """Greedy: {"tokens", "ttft" (s from the call to the first token), "after_first" (s from the
        first token to the last)}. EOS ends it unless stop_at_eos is False (then it is suppressed)."""
        return self._ask(ids=ids, n=n, stop_at_eos=stop_at_eos)

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)


def build_for(variant: str | None) -> str:
    """The llama.cpp build to set beside a wafer kernel variant: AVX2 only for wafer's AVX2-class and
    portable variants, every instruction set of the CPU otherwise."""
    return "avx2" if variant in ("avx2", "portable") else "native"


def available(isa: str = "native") -> bool:
    return (build_path(isa) / "llama_cpp").is_dir()


def _worker(model: str, n_ctx: int, threads: int) -> None:
    from llama_cpp import Llama, llama_print_system_info

    llm = Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    eos = llm.token_eos()
    print(json.dumps({"system_info": llama_print_system_info().decode()}), flush=True)

    def suppress(_ids, scores):
        scores[eos] = -1e9
        return scores

    for line in sys.stdin:
        req = json.loads(line)
        out: list[int] = []
        t0 = time.perf_counter()
        first = t0
        processors = None if req["stop_at_eos"] else [suppress]
        llm.reset()  # or llama-cpp-python reuses the previous call's KV for a shared prefix
        for tok in llm.generate(req["ids"], temp=0.0, top_k=1, reset=True, logits_processor=processors):
            if not out:
                first = time.perf_counter()
            if tok == eos and req["stop_at_eos"]:
                break
            out.append(int(tok))
            if len(out) >= req["n"]:
                break
        end = time.perf_counter()
        print(json.dumps({"tokens": out, "ttft": first - t0, "after_first": end - first}), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
