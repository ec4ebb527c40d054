"""Times the kernels' one machine-dependent parameter on this machine and keeps the fastest.

A decode step streams every weight once, and how fast a core streams depends on how many lines it
keeps in flight and how its own prefetchers follow a stream: the software prefetch distance that
helps one microarchitecture slows another. So each linear shape of the installed models is timed
with each candidate distance (none, a few fixed distances, the default of one group's row), its
records copied until they outsize the caches so that they come from memory as in a step, the
candidates taken in turn over several rounds (a shared host's speed drifts), and the median kept.
A candidate replaces the default only where it is faster by more than MARGIN; the choice never
changes a result, only when the bytes arrive.

Beside them it measures the machine's read bandwidth (at the best of the same distances) and the
variant's int8 peak (probe.h), which
`wafer info` and bench/kernel_roofline.py print the kernels' speed against.

`python -m wafer.kernels --tune` and `wafer models install` run it; the result goes to
tuning.py's cache for this CPU, variant and kernel sources.
"""

from __future__ import annotations

import gc
import logging
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import torch

from wafer.kernels import build
from wafer.kernels.tuning import Shape, ShapeTuning, Tuning, apply, key_for, path_in, save

log = logging.getLogger("wafer.kernels")

STREAM_BYTES = 256 << 20  # a shape's copies together: several times any last-level cache here
PROBE_BYTES = 512 << 20  # the read-bandwidth buffer
FIXED_DISTANCES = (0, 1024, 4096, 16384)  # bytes; 0: no software prefetch
ROUNDS = 5
MARGIN = 0.03  # a candidate must beat the default by this share of its time to replace it


def default_ahead(packed: torch.Tensor) -> int:
    """The distance an untuned shape takes (blockquant.h's group_row_bytes): one group's row of records,
    [groups, records, record bytes] as packed."""
    return int(packed.shape[1] * packed.shape[2])


def candidates(packed: torch.Tensor) -> list[int]:
    return sorted({*FIXED_DISTANCES, default_ahead(packed)})


def choose(times: dict[int, list[float]], default: int, margin: float = MARGIN) -> int:
    """The candidate of the lowest median time, if it is faster than the default beyond the noise:
    its upper quartile below the default's lower quartile less `margin`; else the default. On a busy
    machine the rounds spread, and the default stays."""
    best = min(times, key=lambda c: statistics.median(times[c]))
    if best == default:
        return default
    return best if _quartiles(times[best])[1] < _quartiles(times[default])[0] * (1.0 - margin) else default


def _quartiles(ts: list[float]) -> tuple[float, float]:
    if len(ts) < 2:
        return ts[0], ts[0]
    q = statistics.quantiles(ts, n=4, method="inclusive")
    return q[0], q[2]


def time_candidates(run: Callable[[int], float], cands: list[int], rounds: int = ROUNDS) -> dict[int, list[float]]:
    """Seconds of run(candidate) in each round, the candidates taken in turn, each round starting one
    further on, after one untimed run of each."""
    for c in cands:
        run(c)
    times: dict[int, list[float]] = {c: [] for c in cands}
    for r in range(rounds):
        for c in cands[r % len(cands):] + cands[:r % len(cands)]:
            times[c].append(run(c))
    return times


def stream_runner(module: ModuleType, packed: torch.Tensor, shape: Shape, rows: int = 1,
                  total: int | None = None) -> Callable[[int], float]:
    """run(ahead): seconds of one block_linear of `rows` rows over the shape's records, read from
    memory (copies of `packed` that together outsize the caches, STREAM_BYTES unless `total` says,
    one after another)."""
    total = STREAM_BYTES if total is None else total
    copies = [packed.clone() for _ in range(max(2, -(-total // max(1, packed.numel()))))]
    x = torch.randn(rows, shape.inp)
    return lambda ahead: module.stream_linear(copies, x, shape.out, ahead) / len(copies)


def shapes_of(model: torch.nn.Module) -> dict[Shape, torch.Tensor]:
    """Each distinct linear shape of a model on the block kernels' paths, with one of its tensors of records."""
    found: dict[Shape, torch.Tensor] = {}
    for mod in model.modules():
        packed = getattr(mod, "packed", None)
        if isinstance(packed, torch.Tensor) and hasattr(mod, "fmt") and hasattr(mod, "out_features"):
            found.setdefault(Shape(int(mod.fmt), int(mod.out_features), int(mod.in_features)), packed)
    return found


def measure_machine(module: ModuleType, thread_counts: Iterable[int], repeats: int = 5
                    ) -> tuple[dict[int, float], dict[int, float]]:
    """({threads: read GB/s}, {threads: int8 operations a second}), the best of `repeats` each."""
    buf = torch.ones(PROBE_BYTES, dtype=torch.uint8)
    before = torch.get_num_threads()
    read, peak = {}, {}
    try:
        for t in sorted(set(thread_counts)):
            torch.set_num_threads(t)
            module.read_pass(buf)
            # At the best distance of the kernels' own candidates: the kernels prefetch, so a read without
            # would understate what they can have.
            read[t] = PROBE_BYTES / min(module.read_pass(buf, ahead) for _ in range(repeats)
                                        for ahead in FIXED_DISTANCES) / 1e9
            module.int8_peak(10_000)
            peak[t] = max(module.int8_peak(200_000) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return read, peak


def tune(module: ModuleType, variant: str, shapes: dict[Shape, torch.Tensor], threads: int | None = None,
         rounds: int = ROUNDS, say: Callable[[str], None] = log.info) -> Tuning:
    """Time every shape's candidates on `threads` threads (default: torch's), and measure the machine."""
    threads = threads or torch.get_num_threads()
    read, peak = measure_machine(module, {1, threads})
    tuning = Tuning(key=key_for(variant, build.fingerprint(build.BY_NAME[variant])), threads=threads,
                    read_gbps=read, int8_ops=peak)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape, packed in sorted(shapes.items(), key=lambda kv: (kv[0].fmt, kv[0].out, kv[0].inp)):
            run = stream_runner(module, packed, shape)
            times = time_candidates(run, candidates(packed), rounds)
            default = default_ahead(packed)
            chosen = choose(times, default)
            median = {c: statistics.median(ts) for c, ts in times.items()}
            tuning.shapes.append(ShapeTuning(shape, chosen, default, median[default] / median[chosen]))
            say(f"  format {shape.fmt:>2}, {shape.out:>6} x {shape.inp:<5}: " +
                "  ".join(f"{c}: {packed.numel() / median[c] / 1e9:.1f}" for c in sorted(median)) +
                f" GB/s -> {chosen}")
            del run
            gc.collect()
    finally:
        torch.set_num_threads(before)
    return tuning


def installed_shapes() -> dict[Shape, torch.Tensor]:
    """The linear shapes of every installed catalog model on its default compute path."""
    from wafer.models import catalog
    from wafer.models.loader import load_model

    shapes: dict[Shape, torch.Tensor] = {}
    for m in catalog.MODELS:
        path = catalog.installed_path(m)
        if path is not None:
            add_shapes(shapes, load_model(str(path), compute="auto").model)
            gc.collect()
    return shapes


def add_shapes(shapes: dict[Shape, torch.Tensor], model: torch.nn.Module) -> None:
    """Add a model's shapes not yet in `shapes`, each with a copy of its records (the model may go)."""
    for shape, packed in shapes_of(model).items():
        if shape not in shapes:
            shapes[shape] = packed.clone()


def tune_installed(shapes: dict[Shape, torch.Tensor] | None = None, say: Callable[[str], None] = print) -> Path | None:
    """Tune the active variant on `shapes` (default: the installed models'), keep what an earlier tuning
    on this machine found for other shapes, save the result and apply it. The cache's path, or None
    where wafer's kernels do not run."""
    status = build.status()
    if status.variant is None:
        say(f"the kernels are not tuned: {status.problem}")
        return None
    module = build.load(status.variant)
    shapes = installed_shapes() if shapes is None else shapes
    say(f"tuning wafer's {status.variant} kernels for {len(shapes)} linear shapes on "
        f"{torch.get_num_threads()} threads (prefetch distance in bytes: GB/s at 1 row)")
    tuning = tune(module, status.variant, shapes, say=say)
    earlier = build.tuned(status.variant)
    if earlier is not None:
        timed = {s.shape for s in tuning.shapes}
        tuning.shapes += [s for s in earlier.shapes if s.shape not in timed]
    path = path_in(build.build_dir(), status.variant)
    save(path, tuning)
    apply(module, tuning)
    build.tuned.cache_clear()
    say(tuning.summary())
    say(f"saved to {path}")
    return path
