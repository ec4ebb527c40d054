"""The three tiers in one table, each against llama.cpp built for this machine, measured in one run.

For each tier installed (luna, terra, sol): single-stream decode tokens/s of wafer (with this machine's
kernel tuning, and without it where there is one) and of llama-cpp-python on the same GGUF; the share
of this machine's read bandwidth each reads at that rate; time to first token of a 1024- and a
4096-token prompt; 16 sequences decoding together; and the int8 operations a second that wafer's
1024-token prompt makes of its linears, over the int8 peak measured here (probe.h).

Greedy, EOS suppressed, the repeats taken round-robin over the systems (a shared host's slow spell hits
each alike), the read bandwidth measured in every round beside them; medians. bench/decode.py gives one
model in more detail; bench/kernel_roofline.py the kernels shape by shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import PROMPT, table  # noqa: E402
from bench.decode import THREADS, concurrent, gguf_step_bytes, read_bandwidth, step_bytes, wafer_runner  # noqa: E402

LONG = (1024, 4096)


def linear_ops_per_token(model: torch.nn.Module) -> int:
    """Two operations per weight of every linear on the block kernels (the matrix work of a prompt token)."""
    return sum(2 * m.out_features * m.in_features for m in model.modules() if hasattr(m, "packed"))


def measure_tier(tier: str, args: argparse.Namespace, peak: float) -> list[str] | None:
    from bench.llamacpp import LlamaCpp, available, build_for
    from wafer.kernels import build, tuning
    from wafer.models import catalog
    from wafer.models.loader import load_model

    m = catalog.find(tier)
    path = catalog.installed_path(m) if m else None
    if path is None:
        print(f"{tier}: not installed, skipped", file=sys.stderr)
        return None
    variant = build.status().variant
    module = build.load(variant) if variant else None
    tuned = build.tuned(variant) if variant else None
    loaded = load_model(str(path), compute="auto")
    max_len = max(LONG) + args.tokens + 64
    prompt_ids, run = wafer_runner(args.tokens, loaded=loaded, max_model_len=max_len)
    systems = {"wafer": run}
    if tuned is not None and module is not None:  # the same model, its fused step made with every shape's default
        module.set_prefetch([])
        systems["wafer untuned"] = wafer_runner(args.tokens, loaded=loaded, max_model_len=max_len)[1]
        tuning.apply(module, tuned)
    lc_isa = build_for(variant)
    lc = None
    if available(lc_isa):
        lc = LlamaCpp(lc_isa, n_ctx=max_len, threads=THREADS, model=str(path))

        def lc_run(ids: list[int], n: int = args.tokens) -> tuple[float, float]:
            r = lc.generate(ids, n, stop_at_eos=False)  # type: ignore[union-attr]
            return r["ttft"], (n - 1) / r["after_first"] if n > 1 else 0.0

        systems["llama.cpp"] = lc_run
    ids = prompt_ids(PROMPT)
    filler = prompt_ids(" ".join(["The lighthouse stood on the rocky shore and watched the sea."] * 900))
    longs = {n: filler[: n - 8] + ids[-8:] for n in LONG}
    for r in systems.values():
        r(ids, 8)
    decode: dict[str, list[float]] = {s: [] for s in systems}
    bandwidths, batch = [], []
    for _ in range(args.repeats):
        for name, r in systems.items():
            decode[name].append(r(ids)[1])
        bandwidths.append(read_bandwidth())
        batch.append(concurrent(loaded, 16, ids, 64))
    ttft: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.long_repeats):
        for n, long_ids in longs.items():
            for name in ("wafer", "llama.cpp"):
                if name in systems:
                    ttft.setdefault((name, n), []).append(systems[name](long_ids, 1)[0])
    if lc:
        lc.close()
    med = {s: statistics.median(v) for s, v in decode.items()}
    bw = statistics.median(bandwidths)
    wafer_bytes, lc_bytes = step_bytes(loaded), gguf_step_bytes(str(path))

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    t = {k: statistics.median(v) for k, v in ttft.items()}
    lc_dec = med.get("llama.cpp")
    prompt_ops = linear_ops_per_token(loaded.model) * LONG[0] / t[("wafer", LONG[0])]
    cells = [tier, f"{med['wafer']:.1f}", f"{med['wafer untuned']:.1f}" if "wafer untuned" in med else "-",
             f"{lc_dec:.1f}" if lc_dec else "-", ratio(med["wafer"], lc_dec),
             f"{wafer_bytes * med['wafer'] / 1e9 / bw:.0%}", f"{lc_bytes * lc_dec / 1e9 / bw:.0%}" if lc_dec else "-"]
    for n in LONG:
        w, c = t[("wafer", n)], t.get(("llama.cpp", n))
        cells.append(f"{w:.2f} / {c:.2f} ({w / c:.2f}x)" if c else f"{w:.2f} / -")
    cells += [f"{statistics.median(batch):.1f}", f"{prompt_ops / peak:.0%}" if peak else "-"]
    print(f"{tier}: {' | '.join(cells)} (bandwidth {bw:.1f} GB/s, {min(bandwidths):.1f} to {max(bandwidths):.1f})",
          file=sys.stderr, flush=True)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="luna,terra,sol")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-repeats", type=int, default=1, help="rounds of the long prompts' TTFT")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    from wafer.kernels import build, tuner
    from wafer.kernels.machine import cpu

    variant = build.status().variant
    peak = 0.0
    if variant:
        _, peaks = tuner.measure_machine(build.load(variant), {THREADS})
        peak = peaks[THREADS]
    c = cpu()
    tuned = build.tuned(variant) if variant else None
    rows = [r for tier in args.tiers.split(",") if (r := measure_tier(tier, args, peak))]
    print(f"CPU: {c.describe()}, {os.cpu_count()} cores; {build.features_line()}")
    print(f"wafer kernels: {variant or 'off'}; {tuned.summary() if tuned else 'not tuned for this CPU'}; "
          f"{THREADS} threads; int8 peak measured: {peak / 1e9:.0f} GOPS")
    print(f"decode: {args.tokens} new tokens, median of {args.repeats} rounds; TTFT: median of {args.long_repeats}")
    print(table(["tier", "wafer tok/s", "untuned", "llama.cpp tok/s", "decode ratio", "wafer share of read bw",
                 "llama.cpp share", *(f"TTFT {n} s, wafer / llama.cpp" for n in LONG), "16 streams tok/s",
                 f"prompt {LONG[0]}: linear ops of int8 peak"], rows))


if __name__ == "__main__":
    main()
