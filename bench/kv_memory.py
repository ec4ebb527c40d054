"""KV-cache thrift, measured side by side in one run (issue 22).

1. KV bytes per token for each KV dtype, for the default model and Gemma 3 270M, and what a
   32K-token Gemma 3 context needs with its windowed layers kept to their window and without.
2. `wafer serve` (the default model, f32 KV): resident memory after 16 concurrent requests of
   1,000 prompt tokens that share a 600-token prefix, with prefix caching and without, against what
   their live tokens need.
3. How many 4,096-token sequences fit in a 1 GB KV budget, for each dtype.
4. Decode tokens/s at contexts of 128, 2,048 and 8,128 tokens (the default model's 8,192 less the
   output) for each KV dtype, for both models, against llama-cpp-python on the same GGUF at the
   same context (its default KV type, f16).

Run on a quiet machine: `python bench/kv_memory.py` (add --quick for contexts 128 and 2,048 only).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import table  # noqa: E402
from bench.decode import cpu_model  # noqa: E402
from bench.llamacpp import LlamaCpp, available  # noqa: E402
from wafer.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from wafer.engine.kv_cache import BLOCK, KV_DTYPES, bytes_per_token  # noqa: E402
from wafer.engine.sequence import SamplingParams  # noqa: E402
from wafer.models import catalog  # noqa: E402
from wafer.models.gguf_loader import GGUFFile  # noqa: E402
from wafer.models.loader import default_model_path, load_model  # noqa: E402

MB = 1024 * 1024


def models() -> list[tuple[str, Path]]:
    found = [("SmolLM2-135M-Instruct", default_model_path())]
    gemma = catalog.find("gemma-3-270m")
    path = catalog.installed_path(gemma) if gemma is not None else None
    if path is not None:
        found.append((gemma.name, path))
    return found


def bytes_table() -> None:
    rows = []
    for name, path in models():
        cfg = GGUFFile(path).config
        windows = cfg.windows
        for label, dtype in KV_DTYPES.items():
            per = bytes_per_token(cfg, dtype)
            per_layer = per // cfg.num_layers
            ctx = 32768
            whole = per * ctx
            windowed = sum(per_layer * (ctx if w is None else min(ctx, w + BLOCK)) for w in windows)
            rows.append([name, label, f"{per:,}", f"{whole / MB:,.0f}", f"{windowed / MB:,.0f}",
                         f"{windowed / whole:.2f}", f"{(1024**3) // (per * 4096)}"])
    print("KV bytes per token, and a 32K-token context (MB): all layers whole, and windowed layers kept to "
          "their window (wafer's cache holds the first today: windows do not yet free memory)")
    print(table(["model", "KV dtype", "bytes/token", "32K whole MB", "32K windowed MB", "ratio",
                 "4,096-token seqs in 1 GB"], rows))


NEW = 160  # tokens each request writes: enough that all 16 are running at once before the first ends


def serve_memory(prefix_caching: bool) -> tuple[float, float, float, int]:
    """RSS (MB) of `wafer serve` idle and after the 16 requests, the most KV (MB) its sequences held
    at once, and the tokens they hold when all 16 are running whole."""
    import httpx

    from bench.served import start

    args = [str(default_model_path()), "--max-running", "16", "--max-model-len", "2048",
            "--max-batched-tokens", "1024", "--kv-cache-dtype", "f32"]
    if not prefix_caching:
        args.append("--no-prefix-caching")
    server = start(args, ROOT / "bench" / "out" / "kv-memory-server.log")
    try:
        model = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
        idle = server.rss_mb()
        # 1,000 prompt tokens as ids: a 600-token prefix, then 400 of each request's own.
        prefix = [100 + (i * 37) % 20000 for i in range(600)]

        async def one(client, i: int) -> None:
            own = [100 + (i * 400 + j * 53) % 20000 for j in range(400)]
            r = await client.post(server.base_url + "/completions", json={
                "model": model, "prompt": prefix + own, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()

        async def all16() -> None:
            async with httpx.AsyncClient(timeout=600) as c:
                await asyncio.gather(*(one(c, i) for i in range(16)))

        asyncio.run(all16())
        server.wait_idle()
        after = server.rss_mb()
        metrics = httpx.get(server.root + "/metrics").text
        peak = gauge(metrics, "wafer:kv_cache_peak_usage_perc") * gauge(metrics, "wafer:kv_cache_capacity_bytes") / MB
        # All 16 whole: with prefix caching the prefix once and each request's own 400 + NEW - 1 (the
        # last token sampled is never fed back); without, every request's 1,000 + NEW - 1.
        own = 400 + NEW - 1
        return idle, after, peak, 600 + 16 * own if prefix_caching else 16 * (600 + own)
    finally:
        server.stop()


def gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def memory_table() -> None:
    cfg = GGUFFile(default_model_path()).config
    per = bytes_per_token(cfg, torch.float32)
    rows = []
    for caching in (True, False):
        idle, after, peak, live = serve_memory(caching)
        need = live * per / MB
        rows.append(["on" if caching else "off", f"{idle:,.0f}", f"{after:,.0f}", f"{after - idle:,.0f}",
                     f"{peak:,.0f}", f"{live:,}", f"{need:,.0f}", f"{peak / need:.2f}"])
    print(f"\n`wafer serve` (default model, f32 KV), 16 concurrent requests of 1,000 prompt tokens sharing a "
          f"600-token prefix, {NEW} tokens each")
    print(table(["prefix caching", "RSS idle MB", "RSS after MB", "RSS grew MB", "KV held at peak MB",
                 "tokens of 16 whole", "their KV MB", "peak / their KV"], rows))
    print("(tokens of 16 whole: with prefix caching the shared prefix once and each request's own tokens; "
          "without, every request's whole prompt and output. RSS keeps every block ever written.)")


def wafer_decode(loaded, dtype: str, context: int, n_new: int = 32) -> float:
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=context + n_new + 16,
                                            max_batched_tokens=1024, kv_cache_dtype=dtype))
    prompt = [1] + [100 + (i * 37) % 20000 for i in range(context - 1)]
    seq = engine.add(prompt, SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))
    while len(seq.tokens) == len(prompt):
        engine.step()
    t0 = time.perf_counter()
    while not seq.finished:
        engine.step()
    return (n_new - 1) / (time.perf_counter() - t0)


def decode_table(contexts: list[int]) -> None:
    for name, path in models():
        loaded = load_model(str(path), compute="auto")
        llama = LlamaCpp(n_ctx=max(contexts) + 64, model=str(path)) if available() else None
        rows = []
        for ctx in contexts:
            base = None
            if llama is not None:
                prompt = [1] + [100 + (i * 37) % 20000 for i in range(ctx - 1)]
                out = llama.generate(prompt, 32, stop_at_eos=False)
                base = (len(out["tokens"]) - 1) / out["after_first"]
            for dtype in KV_DTYPES:
                if dtype == "fp8":  # for GPUs; the CPU's fused step reads the others
                    continue
                tps = wafer_decode(loaded, dtype, ctx)
                rows.append([str(ctx), dtype, f"{tps:.1f}", f"{base:.1f}" if base else "n/a",
                             f"{tps / base:.2f}x" if base else "n/a"])
        if llama is not None:
            llama.close()
        print(f"\nDecode at a context, {name} on {loaded.compute} ({loaded.kernels}); llama.cpp native build, "
              "f16 KV, same GGUF")
        print(table(["context", "wafer KV", "wafer tok/s", "llama.cpp tok/s", "ratio"], rows))
        del loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="decode at 128 and 2,048 tokens of context only")
    ap.add_argument("--skip-serve", action="store_true", help="leave out the server memory runs")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()} ({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    bytes_table()
    if not args.skip_serve:
        memory_table()
    decode_table([128, 2048] if args.quick else [128, 2048, 8128])  # 8,128 + 64: the model's 8,192


if __name__ == "__main__":
    main()
