"""KV-cache thrift, measured side by side in one run (issue 22).

1. KV bytes per token for each KV dtype, for the default model and Gemma 3 270M, and what one
   sequence of the model's whole context (32K tokens for Gemma 3) holds in wafer's cache, with
   windowed layers keeping their window (the default) and with every layer keeping every token.
2. `wafer serve` (each model, f32 KV): resident memory after 16 concurrent requests of 1,000
   prompt tokens that share a 600-token prefix, with prefix caching and without, against what
   their live tokens need.
3. How many 4,096-token sequences fit in a 1 GB KV budget, for each dtype, with and without windows.
4. Decode tokens/s at contexts of 128, 2,048 and 8,128 tokens (the default model's 8,192 less the
   output) for each KV dtype, for both models, against llama-cpp-python on the same GGUF at the
   same context (its default KV type, f16).

Run on a quiet machine: `python bench/kv_memory.py` (add --quick for contexts 128 and 2,048 only).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
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
from wafer.engine.block_manager import KVCacheFull  # noqa: E402
from wafer.engine.config import EngineConfig  # noqa: E402
from wafer.engine.engine import LLMEngine  # noqa: E402
from wafer.engine.kv_cache import KVCache  # noqa: E402
from wafer.engine.kv_layout import BLOCK, KV_DTYPES, bytes_per_token, layer_bytes_per_token, plan_blocks  # noqa: E402
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


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def held_context(cfg, dtype: torch.dtype, ctx: int, windows: bool, step: int = 256) -> tuple[float, float]:
    """A sequence of `ctx` tokens taken into wafer's cache as the engine does it, `step` tokens at a
    time (blocks reserved, every new block of every layer written, then set_length, where windowed
    layers give back what has left their window): the most KV bytes it held at once (MB, the
    cache's own count) and how much the process's resident memory grew (MB)."""
    gc.collect()
    before = rss_mb()
    kv = KVCache(cfg, 1, ctx, dtype, max_step=step, window_pool=None if windows else 0)
    slot, _ = kv.blocks.allocate(list(range(ctx)))
    done = 0
    while done < ctx:
        end = min(ctx, done + step)
        kv.blocks.reserve(slot, end)
        for layer, (k, v) in enumerate(kv.layers):
            blocks = kv.blocks.blocks_of(slot, kv.blocks.layer_group[layer])[done // BLOCK : -(-end // BLOCK)]
            k[:, blocks] = 1
            v[:, blocks] = 1
        kv.blocks.set_length(slot, end)
        done = end
    grew = rss_mb() - before
    peak = kv.blocks.peak_bytes / MB
    del kv
    gc.collect()
    return peak, grew


def sequences_in(cfg, dtype: torch.dtype, budget: int, length: int, windows: bool, step: int = 256) -> int:
    """How many `length`-token sequences wafer's cache holds at once within `budget` bytes: the most
    slots whose pools (sized by the engine's rule) take every sequence whole, each computed
    `step` tokens at a time."""
    fits = 0
    for n in range(1, 1024):
        blocks, pool = plan_blocks(cfg, dtype, n, length, budget, step, windows)
        kv = KVCache(cfg, n, length, dtype, num_blocks=blocks, max_step=step, window_pool=pool)
        if kv.blocks.capacity_bytes > budget:
            break
        try:
            slots = [kv.blocks.allocate()[0] for _ in range(n)]
            for end in range(step, length + step, step):  # the sequences side by side, a step each
                for slot in slots:
                    kv.blocks.reserve(slot, min(end, length))
                    kv.blocks.set_length(slot, min(end, length))
        except KVCacheFull:
            break
        fits = n
    return fits


def bytes_table() -> bool:
    rows, fits, ok = [], [], True
    for name, path in models():
        cfg = GGUFFile(path).config
        ctx = min(32768, cfg.max_position_embeddings)
        for label, dtype in KV_DTYPES.items():
            per = bytes_per_token(cfg, dtype)
            whole, whole_rss = held_context(cfg, dtype, ctx, windows=False)
            held, held_rss = held_context(cfg, dtype, ctx, windows=True)
            rows.append([name, label, f"{per:,}", f"{ctx:,}", f"{per * ctx / MB:,.0f}", f"{whole:,.0f}",
                         f"{whole_rss:,.0f}", f"{held:,.0f}", f"{held_rss:,.0f}", f"{held / whole:.2f}"])
            if "gemma" in name:
                ok &= held / whole <= 0.25
            fits.append([name, label, str(sequences_in(cfg, dtype, 1 << 30, 4096, windows=False)),
                         str(sequences_in(cfg, dtype, 1 << 30, 4096, windows=True))])
    print("KV of one sequence taken in 256 tokens a step to the model's context (32K for Gemma 3, 8K for "
          "SmolLM2): every layer keeping every token, and windowed layers keeping their window (wafer's "
          "default). Held: the cache's count of the bytes its blocks held at the peak; RSS: what the process grew")
    print(table(["model", "KV dtype", "bytes/token", "context", "all tokens MB (computed)", "no windows: held MB",
                 "no windows: RSS MB", "windows: held MB", "windows: RSS MB", "held, windows / none"], rows))
    print("\n4,096-token sequences that wafer's cache holds at once in a 1 GB KV budget (pools sized by the "
          "engine's rule for that many slots, every sequence taken in whole, 256 tokens a step)")
    print(table(["model", "KV dtype", "without windows", "with windows"], fits))
    print(f"{'PASS' if ok else 'FAIL'}  Gemma 3's KV for a 32K context at most 1/4 of what it holds without windows")
    return ok


NEW = 160  # tokens each request writes: enough that all 16 are running at once before the first ends


def serve_memory(path: Path, prefix_caching: bool) -> tuple[float, float, float, float]:
    """RSS (MB) of `wafer serve` idle and after the 16 requests, the most KV (MB) its sequences held
    at once, and the KV (MB) their live tokens need when all 16 are running whole."""
    import httpx

    from bench.served import start

    # No bound on a step's prompt work but max_batched_tokens: all 16 are admitted within a few
    # steps and run whole together, on a slow machine too (with the default 50 ms bound, one there
    # admitted a request a second and never held more than 8 at once).
    args = [str(path), "--max-running", "16", "--max-model-len", "2048",
            "--max-batched-tokens", "1024", "--prefill-step-ms", "0", "--kv-cache-dtype", "f32"]
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
        return idle, after, peak, live_need(GGUFFile(path).config, prefix_caching) / MB
    finally:
        server.stop()


def live_need(cfg, prefix_caching: bool) -> int:
    """Bytes of f32 KV that the 16 requests' live tokens need when all are running whole: in a layer
    that attends to everything, with prefix caching the prefix once and each request's own
    400 + NEW - 1 (the last token sampled is never fed back), without it every request's 1,000 +
    NEW - 1; in a windowed layer each request's last window."""
    own, whole = 400 + NEW - 1, 1000 + NEW - 1
    per_layer = layer_bytes_per_token(cfg, torch.float32)
    need = 0
    for w in cfg.windows:
        if w is not None and w < 2048:
            need += 16 * min(w, whole) * per_layer
        else:
            need += (600 + 16 * own if prefix_caching else 16 * whole) * per_layer
    return need


def gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def memory_table() -> None:
    rows = []
    for name, path in models():
        for caching in (True, False):
            idle, after, peak, need = serve_memory(path, caching)
            rows.append([name, "on" if caching else "off", f"{idle:,.0f}", f"{after:,.0f}", f"{after - idle:,.0f}",
                         f"{peak:,.0f}", f"{need:,.0f}", f"{peak / need:.2f}"])
    print(f"\n`wafer serve` (f32 KV), 16 concurrent requests of 1,000 prompt tokens sharing a 600-token prefix, "
          f"{NEW} tokens each")
    print(table(["model", "prefix caching", "RSS idle MB", "RSS after MB", "RSS grew MB", "KV held at peak MB",
                 "KV their live tokens need MB", "peak / need"], rows))
    print("(need, with all 16 running whole: in layers that attend to everything, with prefix caching the shared "
          "prefix once and each request's own tokens, without it every request's whole prompt and output; in "
          "windowed layers each request's last window. RSS keeps every block ever written.)")


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
