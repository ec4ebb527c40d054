"""Where and how a model's weights are computed with."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")  # auto: cuda when a GPU is visible


@dataclass
class LoadSettings:
    # The compute path (wafer/models/quant.py's PATHS): auto is the file's own weights on the CPU,
    # q4 for the bundled model, bf16 on CUDA.
    quant: str = "auto"
    device: str = "auto"  # one of DEVICES
