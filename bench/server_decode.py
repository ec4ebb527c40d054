"""Single-stream decode through the server vs in the engine, side by side in one run.

The same chat prompt, greedy, EOS ignored, 256 new tokens: once with the engine in this process, once
through `wafer serve` (a subprocess on loopback) with the official `openai` client, streamed. Decode
tokens/s counts the tokens after the first over the time after the first; median of 3 each. The
server runs first and is stopped before the engine is timed, so the two never share the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PROMPT, table  # noqa: E402
from bench.decode import THREADS  # noqa: E402
from bench.prefix_cache import serve  # noqa: E402


def through_server(base_url: str, model: str, n: int) -> float:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="bench", max_retries=0)
    first, count = None, 0
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    return (count - 1) / (time.perf_counter() - first)  # type: ignore[operator]


def in_engine(quant: str, n: int, repeats: int) -> list[float]:
    import torch

    from wafer.engine.engine import EngineConfig, LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model

    torch.set_num_threads(THREADS)
    loaded = load_model(compute=quant)
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=2048, prefix_caching=False))
    ids = loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": PROMPT}]),
                                  add_special_tokens=False)
    speeds = []
    for _ in range(repeats + 1):  # the first is a warm-up
        seq = engine.add(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        first = None
        while not seq.finished:
            engine.step()
            if first is None and seq.output_ids:
                first = time.perf_counter()
        speeds.append((n - 1) / (time.perf_counter() - first))  # type: ignore[operator]
    return speeds[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8431)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    from wafer.models.loader import display_name

    proc = serve(args.port, ["--quant", args.quant, "--max-running", "1"])
    try:
        url = f"http://127.0.0.1:{args.port}/v1"
        through_server(url, display_name(None), 16)  # warm-up
        http = [through_server(url, display_name(None), args.tokens) for _ in range(args.repeats)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    engine = in_engine(args.quant, args.tokens, args.repeats)
    a, b = statistics.median(engine), statistics.median(http)
    print(f"Single-stream decode, default model ({args.quant}), {args.tokens} new tokens, greedy, EOS ignored, "
          f"{THREADS} threads, median of {args.repeats}")
    print(table(["where", "decode tok/s", "vs engine"],
                [["engine, in process", f"{a:.1f}", "1.00x"],
                 ["wafer serve + openai SDK (streamed)", f"{b:.1f}", f"{b / a:.2f}x"]]))


if __name__ == "__main__":
    main()
