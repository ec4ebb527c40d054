"""Single-stream decode through the server vs in the engine, side by side in one run.

The same chat prompt, greedy, EOS ignored, 256 new tokens: once with the engine in this process, once
through `wafer serve` (a subprocess on loopback), streamed, once with `wafer bench`'s client (httpx)
and once with the official `openai` client, whose own parsing of each chunk takes a core's time
away from the server on this 2-core machine (measured: 0.47 ms of client CPU per token). Decode
tokens/s counts the tokens after the first over the time after the first; median of 5 each, the
runs alternating between the two (the idle server takes no CPU while the engine runs, and the engine
is idle while the server runs), so that a slow spell of this shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import PROMPT, table  # noqa: E402
from bench.decode import THREADS, wafer_runner  # noqa: E402
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


def through_bench_client(base_url: str, model: str, n: int) -> float:
    """The same request with `wafer bench`'s client (httpx and json, no response models): on a
    2-core machine a client's own parsing competes with the server for the cores."""
    import asyncio

    import httpx

    from wafer.benchmark.client import send
    from wafer.benchmark.workload import Prompt

    async def go():  # type: ignore[no-untyped-def]
        async with httpx.AsyncClient() as client:
            return await send(client, base_url, "chat", model, Prompt(PROMPT, None, n), None, True, 300.0)

    rec = asyncio.run(go())
    return (rec.usage_completion - 1) / (rec.end - rec.chunk_times[0])  # type: ignore[operator]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--port", type=int, default=8431)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    from wafer.models.loader import display_name

    proc = serve(args.port, ["--quant", args.quant, "--max-running", "1"])
    try:
        url, name = f"http://127.0.0.1:{args.port}/v1", display_name(None)
        torch.set_num_threads(THREADS)
        prompt_ids, engine = wafer_runner(args.tokens, args.quant, ignore_eos=True)
        ids = prompt_ids(PROMPT)
        through_server(url, name, 16)  # warm-ups
        through_bench_client(url, name, 16)
        engine(ids, 16)
        http, light, local = [], [], []
        for _ in range(args.repeats):  # alternating, so that a slow spell of the machine hits all alike
            http.append(through_server(url, name, args.tokens))
            light.append(through_bench_client(url, name, args.tokens))
            local.append(engine(ids)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    a, b, c = statistics.median(local), statistics.median(http), statistics.median(light)
    print(f"Single-stream decode, default model ({args.quant}), {args.tokens} new tokens, greedy, EOS ignored, "
          f"{THREADS} threads, median of {args.repeats}, taken alternately")
    print(table(["where", "decode tok/s", "vs engine"],
                [["engine, in process", f"{a:.1f}", "1.00x"],
                 ["wafer serve + wafer bench's client (streamed)", f"{c:.1f}", f"{c / a:.2f}x"],
                 ["wafer serve + openai SDK (streamed)", f"{b:.1f}", f"{b / a:.2f}x"]]))


if __name__ == "__main__":
    main()
