"""Where each machine loses: every linear shape of each tier, its block kernel's speed against what
this machine can do, measured in one run.

For each tier (luna, terra, sol, those installed) and each distinct linear shape and record format
of its default compute path: the GB/s the kernel reads at 1 row on one thread and on all (weights
from memory: copies of the records that together outsize the caches), and the int8 operations a
second at 16, 64 and 256 rows on all threads. Beside them, the machine's read bandwidth (one read
pass over 512 MiB, probe.h) on one thread and on all, and the variant's int8 peak (its dot product
from registers and L1), each measured here before the shapes. Shares are of those two.

The kernels run as the server runs them: with this machine's tuning where `python -m wafer.kernels
--tune` (or `wafer models install`) made one, else the default prefetch distance; the `ahead`
column says which distance each shape took, `--untuned` runs every shape at its default.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import table  # noqa: E402

THREADS = 2
ROWS = (16, 64, 256)


def median_seconds(run, repeats: int) -> float:
    run()
    return statistics.median(run() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="luna,terra,sol")
    ap.add_argument("--isa", default="auto", help="wafer's kernel variant (auto: the best this CPU runs)")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--untuned", action="store_true", help="every shape at the default prefetch distance")
    args = ap.parse_args()
    os.environ["WAFER_KERNELS"] = args.isa
    torch.set_num_threads(args.threads)
    from wafer.kernels import build, tuner
    from wafer.kernels.machine import cpu
    from wafer.models import catalog
    from wafer.models.loader import load_model

    status = build.status()
    if status.variant is None:
        sys.exit(f"wafer's kernels do not run here: {status.problem}")
    module = build.load(status.variant)
    tuning = build.tuned(status.variant)
    if args.untuned:
        module.set_prefetch([])
    c = cpu()
    print(f"CPU: {c.describe()}; vendor {c.vendor}; kernels {status.variant}; {args.threads} threads; "
          f"{'untuned (--untuned)' if args.untuned else tuning.summary() if tuning else 'untuned (no tuning for this CPU)'}")
    relevant = sorted({f for v in build.VARIANTS for f in v.needs} | {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"})
    print(f"flags: {' '.join(f for f in c.flags if f in relevant) or 'none of the SIMD flags wafer knows'}")
    read, peak = tuner.measure_machine(module, {1, args.threads})
    print(f"read bandwidth: {read[1]:.1f} GB/s on 1 thread, {read[args.threads]:.1f} GB/s on {args.threads}; "
          f"int8 peak: {peak[1] / 1e9:.0f} GOPS on 1 thread, {peak[args.threads] / 1e9:.0f} GOPS on {args.threads}")
    rows = []
    for tier in args.tiers.split(","):
        m = catalog.find(tier)
        path = catalog.installed_path(m) if m else None
        if path is None:
            print(f"{tier}: not installed, skipped")
            continue
        loaded = load_model(str(path), compute="auto")
        shapes = tuner.shapes_of(loaded.model)
        for shape, packed in sorted(shapes.items(), key=lambda kv: (kv[0].fmt, kv[0].out, kv[0].inp)):
            ahead = module.prefetch_ahead(shape.fmt, shape.out, shape.inp)
            cells = [tier, f"{shape.fmt}", f"{shape.out} x {shape.inp}", f"{packed.numel() / 2**20:.1f}", str(ahead)]
            for t in (1, args.threads):
                torch.set_num_threads(t)
                run = tuner.stream_runner(module, packed, shape)
                gbps = packed.numel() / median_seconds(lambda: run(-1), args.repeats) / 1e9
                cells.append(f"{gbps:.1f} ({gbps / read[t]:.0%})")
                del run
                gc.collect()
            torch.set_num_threads(args.threads)
            for m_rows in ROWS:
                run = tuner.stream_runner(module, packed, shape, rows=m_rows, total=2 * packed.numel())
                ops = 2 * m_rows * shape.out * shape.inp / median_seconds(lambda: run(-1), max(3, args.repeats // 2))
                cells.append(f"{ops / 1e9:.0f} ({ops / peak[args.threads]:.0%})")
                del run
            rows.append(cells)
        del loaded
        gc.collect()
    headers = ["tier", "format", "out x in", "MiB", "ahead", "GB/s 1 row, 1 thread (of read bw)",
               f"GB/s 1 row, {args.threads} threads", *(f"GOPS {r} rows (of peak)" for r in ROWS)]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
