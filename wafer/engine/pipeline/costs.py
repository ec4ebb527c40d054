"""What each layer and the head cost in a decode step, to balance the stages by."""

from __future__ import annotations

import time

import torch

from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK


@torch.inference_mode()
def measured_costs(model: torch.nn.Module, kv_dtype: torch.dtype, threads: int, rows: int = 8
                   ) -> tuple[list[float], float] | None:
    """Seconds a decode step of `rows` sequences takes in each layer and in the head, measured on
    `threads` threads (a stage's share) with wafer's fused step, before the model is cut; None where
    the step is not the fused one (the split then goes by bytes). Per byte, a layer (its attention
    and activations too) and the head cost different amounts: split by bytes, SmolLM2's first stage
    of two took 0.54 ms a token and the second 0.35."""
    from wafer.kernels.fused_decode import FusedDecode

    before = torch.get_num_threads()
    head = model.lm_head
    position = 4 * BLOCK - 1  # a short context, as most steps' attention is next to their weights
    kv = KVCache.for_model(model, rows, position + 1, rows * 4, kv_dtype)  # a scratch cache of its own
    try:
        torch.set_num_threads(threads)
        with_head = FusedDecode.build(model, kv.layers, kv.blocks.layer_group)  # type: ignore[arg-type]
        model.lm_head = None
        without = FusedDecode.build(model, kv.layers, kv.blocks.layer_group)  # type: ignore[arg-type]
        model.lm_head = head
        if with_head is None or without is None:
            return None
        for _ in range(rows):
            slot, _ = kv.blocks.allocate()
            kv.blocks.reserve(slot, position + 1)
        args = (torch.full((rows,), 1, dtype=torch.long), torch.full((rows,), position, dtype=torch.long),
                torch.arange(rows), kv.blocks.tables)

        def best_of(step, out: torch.Tensor) -> float:
            times = []
            for _ in range(7):
                t = time.perf_counter()
                step(*args, out)
                times.append(time.perf_counter() - t)
            return min(times[1:])  # (the first is a warm-up)

        layers_only = best_of(without, torch.empty(0, dtype=torch.long))
        whole = best_of(with_head, torch.arange(rows))
        n = len(model.layers)
        return [layers_only / n] * n, max(0.0, whole - layers_only)
    finally:
        model.lm_head = head
        torch.set_num_threads(before)
