"""A kernel variant's tuning for this machine, as the tuner (tuner.py) leaves it: each linear shape's
weight prefetch distance, and the machine's read bandwidth and int8 peak measured beside them.

It is kept in one JSON file per variant beside the variant's build, under a key naming the CPU
(vendor, model name, family, model, a digest of its flags), the variant and the kernels' sources.
A file whose key differs was measured on another CPU or for other kernels, and is ignored: its
distances say nothing of this machine, and an untuned shape's default serves better."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from wafer.kernels.machine import cpu

log = logging.getLogger("wafer.kernels")
FORMAT = 1  # of the file; a file of another format is foreign


@dataclass(frozen=True)
class Shape:
    """A linear as block_linear sees it: its record format (blockquant.h's Format) and its sizes."""

    fmt: int
    out: int
    inp: int


@dataclass
class ShapeTuning:
    shape: Shape
    ahead: int  # the chosen prefetch distance, bytes
    default: int  # the distance an untuned shape takes
    speedup: float  # the default's time over the chosen one's (1.0: the default was kept)


@dataclass
class Tuning:
    key: dict[str, str]
    threads: int  # the thread count the shapes were timed at
    read_gbps: dict[int, float] = field(default_factory=dict)  # threads -> GB/s of one read pass
    int8_ops: dict[int, float] = field(default_factory=dict)  # threads -> int8 operations a second
    shapes: list[ShapeTuning] = field(default_factory=list)

    def summary(self) -> str:
        """One line for `wafer info` and the start-up log."""
        changed = [s for s in self.shapes if s.ahead != s.default]
        bw = ", ".join(f"{g:.1f} GB/s on {t} thread{'s' if t > 1 else ''}" for t, g in sorted(self.read_gbps.items()))
        peak = ", ".join(f"{o / 1e12:.2f} int8 TOPS on {t}" for t, o in sorted(self.int8_ops.items()))
        return (f"tuned for this CPU: {len(self.shapes)} linear shapes, {len(changed)} with a prefetch distance of "
                f"their own; read bandwidth {bw or 'not measured'}; peak {peak or 'not measured'}")

    def to_json(self) -> dict:
        return {"format": FORMAT, "key": self.key, "threads": self.threads,
                "read_gbps": {str(t): g for t, g in self.read_gbps.items()},
                "int8_ops": {str(t): o for t, o in self.int8_ops.items()},
                "shapes": [{"format": s.shape.fmt, "out": s.shape.out, "in": s.shape.inp, "ahead": s.ahead,
                            "default": s.default, "speedup": round(s.speedup, 4)} for s in self.shapes]}

    @classmethod
    def from_json(cls, data: dict) -> Tuning:
        return cls(key={str(k): str(v) for k, v in data["key"].items()}, threads=int(data["threads"]),
                   read_gbps={int(t): float(g) for t, g in data.get("read_gbps", {}).items()},
                   int8_ops={int(t): float(o) for t, o in data.get("int8_ops", {}).items()},
                   shapes=[ShapeTuning(Shape(int(s["format"]), int(s["out"]), int(s["in"])), int(s["ahead"]),
                                       int(s["default"]), float(s["speedup"])) for s in data.get("shapes", [])])


def key_for(variant: str, fingerprint: str) -> dict[str, str]:
    """What a tuning holds for: this CPU, the variant and the kernels' sources (build.py's fingerprint)."""
    c = cpu()
    return {"vendor": c.vendor, "model_name": c.model_name, "family": c.family, "model": c.model,
            "flags": c.flags_digest(), "variant": variant, "kernels": fingerprint[:16], "format": str(FORMAT)}


def path_in(directory: Path, variant: str) -> Path:
    return directory / f"tuning-{variant}.json"


def save(path: Path, tuning: Tuning) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tuning.to_json(), indent=1))
    tmp.replace(path)


def load(path: Path, key: dict[str, str]) -> Tuning | None:
    """The tuning at path if it was made for `key`; None if there is none, or it is foreign or unreadable
    (said in the log: the kernels then run their defaults)."""
    if not path.exists():
        return None
    try:
        tuning = Tuning.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the kernels' tuning %s: unreadable (%s)", path, e)
        return None
    if tuning.key != key:
        differ = sorted(k for k in set(key) | set(tuning.key) if key.get(k) != tuning.key.get(k))
        log.info("ignoring the kernels' tuning %s: made for another %s", path, ", ".join(differ))
        return None
    return tuning


def apply(module: ModuleType, tuning: Tuning | None) -> None:
    """Give block_linear the tuning's distances (none: every shape its default). A fused model takes
    its linears' distances when it is made, so this comes before models are built."""
    rows = [(s.shape.fmt, s.shape.out, s.shape.inp, s.ahead) for s in tuning.shapes] if tuning else []
    module.set_prefetch(rows)
