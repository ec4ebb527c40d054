"""A pipeline stage's share of a model: a contiguous range of its layers, the embedding on the first
stage and the final norm and head on the last (engine/pipeline/ runs the stages).

The ranges are balanced by what a decode step costs in each layer and in the head, which the engine
measures where wafer's fused step runs (engine/pipeline/costs.py: measured_costs), and otherwise estimates
by the bytes of weights each reads. The head matters: for a small model with a large vocabulary it
weighs as much as several layers (SmolLM2-135M's is 28M of its 135M parameters).
"""

from __future__ import annotations

from torch import nn

from wafer.models.llama import LlamaModel


def _weight_bytes(module: nn.Module) -> int:
    total = 0
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if not name.endswith("norm.weight"):
            total += t.numel() * t.element_size()
    return total


def layer_costs(model: LlamaModel) -> tuple[list[int], int]:
    """Bytes a decode step reads in each layer, and in the head."""
    return [_weight_bytes(layer) for layer in model.layers], _weight_bytes(model.lm_head)


def split_layers(costs: list[float], head: float, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [start, end), one per stage, each non-empty, that make the costliest
    stage (the last one carries the head) as cheap as it can be."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages (each needs a layer)")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (head if b == n else 0)

    # best[s][i]: the least possible maximum over the first i layers in s stages; cut[s][i]: the last cut.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def keep_stage(model: LlamaModel, start: int, end: int) -> None:
    """Reduce `model`, in place, to layers [start, end) and what its stage needs besides: the
    embedding if it is the first, the final norm and head if the last. The block-quantised weights
    kept move into an arena of their own, so that the whole model's arena is freed with the rest."""
    from wafer.models import blockquant as bq
    from wafer.models.quant import BlockLinear

    if not isinstance(model, LlamaModel):
        raise ValueError(f"pipeline stages run the Llama family of models (Llama, Mistral, Qwen2, SmolLM2), "
                         f"not {type(model).__name__}")
    n = len(model.layers)
    if not 0 <= start < end <= n:
        raise ValueError(f"layers [{start}, {end}) are not a range of the model's {n}")
    model.layers = nn.ModuleList(model.layers[start:end])
    if start > 0:
        model.embed_tokens = None  # type: ignore[assignment]
    if end < n:
        model.lm_head = None  # type: ignore[assignment]
    blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
    if blocks:
        arena = bq.HugePageArena(sum(bq.HugePageArena.size_of(m.packed) for m in blocks))
        for m in blocks:
            moved = arena.take(bq.HugePageArena.size_of(m.packed))[: m.packed.numel()]
            moved.copy_(m.packed.reshape(-1))
            m.packed = moved.view(m.packed.shape)
    model.stage = (start, end, n)  # type: ignore[assignment]


def is_first(model: LlamaModel) -> bool:
    return model.embed_tokens is not None


def is_last(model: LlamaModel) -> bool:
    return model.lm_head is not None
