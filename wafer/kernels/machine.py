"""What CPU this is, as precisely as a tuning needs: the vendor, the model's name, its family and
model numbers, and its feature flags. A tuning measured on one CPU is kept for that CPU alone."""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class CPU:
    vendor: str
    model_name: str
    family: str
    model: str
    flags: tuple[str, ...]  # sorted

    def describe(self) -> str:
        """One line: vendor, model name, family/model (the numbers that tell microarchitectures apart)."""
        return f"{self.vendor} {self.model_name} (family {self.family}, model {self.model})"

    def flags_digest(self) -> str:
        return hashlib.sha256(" ".join(self.flags).encode()).hexdigest()[:16]


@cache
def cpu() -> CPU:
    """This CPU as Linux's /proc/cpuinfo gives its first processor (ARM: implementer, part and
    Features); 'unknown' where a field is missing."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                if fields:
                    break
                continue
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    flags = fields.get("flags") or fields.get("Features") or ""
    return CPU(vendor=fields.get("vendor_id") or fields.get("CPU implementer") or "unknown",
               model_name=fields.get("model name") or fields.get("Model") or platform.processor() or "unknown",
               family=fields.get("cpu family") or fields.get("CPU architecture") or "unknown",
               model=fields.get("model") or fields.get("CPU part") or "unknown",
               flags=tuple(sorted(set(flags.split()))))
