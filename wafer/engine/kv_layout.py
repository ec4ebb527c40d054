"""How the KV cache is laid out and sized: blocks of BLOCK tokens, the element types a row may take,
the groups of layers (whole context, or a window) and how a memory budget is shared among their
pools. No tensors and no allocation here: block_manager.py hands the blocks out, kv_cache.py holds
their contents.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from wafer.models.config import ModelConfig

if TYPE_CHECKING:
    from wafer.models.loader import LoadedModel

BLOCK = 16  # tokens per block, hashed and allocated alike
MAX_STEP = 256  # default: the most tokens one sequence computes in a step (a prompt chunk)

KV_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALED = (torch.int8, torch.float8_e4m3fn)  # codes with a float32 scale per position and head


def row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row at one position: int8 and fp8 rows end with their float32 scale's 4 bytes."""
    return head_dim + 4 if dtype in SCALED else head_dim


def layer_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V of one layer for one token."""
    return 2 * cfg.num_kv_heads * row_size(cfg.head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V, all layers, for one token (as a cache without windows holds them)."""
    return cfg.num_layers * layer_bytes_per_token(cfg, dtype)


def layer_groups(cfg: ModelConfig, max_len: int, windows: bool = True) -> tuple[list[int | None], list[int]]:
    """The groups' windows (None: the whole context, the first group where there is one) and each
    layer's group. A window as long as the context saves nothing: such a layer joins the whole
    group, as every layer does without `windows`."""
    kept = [w if windows and w is not None and w < max_len else None for w in cfg.windows]
    kinds: list[int | None] = [None] if None in kept else []
    if any(w is not None for w in kept):
        kinds.append(max(w for w in kept if w is not None))
    return kinds, [0 if w is None else len(kinds) - 1 for w in kept]


def window_blocks(window: int, max_step: int) -> int:
    """The most blocks a sequence holds in a group with `window`: those of its last window before a
    step of up to `max_step` tokens, that step's, and one more where they straddle block edges."""
    return (window - 1 + max_step) // BLOCK + 2


def slot_window(window: int, max_step: int | None, max_blocks: int) -> int:
    """A slot's share of a windowed pool: its window and step, or (no step given) its whole context."""
    return min(window_blocks(window, max_step) if max_step else max_blocks, max_blocks)


def plan_blocks(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_len: int, budget: int,
                max_step: int = MAX_STEP, windows: bool = True) -> tuple[int, int]:
    """How `budget` bytes are shared: the blocks of the whole-context layers' pool (at least 1, at
    most every slot holding max_len tokens), and of the windowed layers' (0: none, every layer
    keeps every token). The windowed pools hold each slot's window and step where the budget holds
    that beside one sequence of max_len in the other layers, else as many slots' as it holds whole
    sequences; where it cannot hold one window and more context than the windows would save, the
    windows are not used."""
    kinds, groups = layer_groups(cfg, max_len, windows)
    per_layer = layer_bytes_per_token(cfg, dtype) * BLOCK
    max_blocks = -(-max_len // BLOCK)
    full = num_slots * max_blocks
    plain = max(1, min(full, budget // (cfg.num_layers * per_layer))), 0
    window = kinds[-1] if kinds and kinds[-1] is not None else None
    if window is None:
        return plain
    per_slot = slot_window(window, max_step, max_blocks)
    windowed = groups.count(len(kinds) - 1) * per_layer * per_slot  # bytes: a slot's window
    whole = groups.count(0) * per_layer if kinds[0] is None else 0  # bytes: a block of the other layers
    if not whole:  # every layer windowed: as many slots' windows as the budget holds
        slots = min(num_slots, budget // windowed)
        return (full, slots * per_slot) if slots else plain
    slots = budget // (windowed + max_blocks * whole)
    if num_slots * windowed + max_blocks * whole <= budget:
        slots = num_slots
    if slots:
        return min(full, (budget - min(slots, num_slots) * windowed) // whole), min(slots, num_slots) * per_slot
    # Not one window beside a whole sequence: windows pay only where they leave more context.
    blocks = (budget - windowed) // whole
    return (blocks, per_slot) if blocks * BLOCK > window and blocks > plain[0] else plain


def kv_dtype(name: str, loaded: LoadedModel) -> torch.dtype:
    """The KV cache's element type. `auto`: bfloat16 on the CPU's quantised paths (q4, q8, int8),
    where it is as fast as float32 at short contexts and faster at long ones, for half the memory
    and no measurable loss; int8 is faster still but costs some precision, so it is asked for, not
    chosen. Elsewhere the model's activation dtype: the f32 path stays the exact reference, and a
    GPU model's is bf16."""
    activations = loaded.model.norm.weight.dtype
    if name == "auto":
        if activations == torch.float32 and loaded.compute in ("q4", "q8", "int8"):
            return torch.bfloat16
        return activations
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_DTYPES)}, not {name!r}")
    if name == "fp8" and loaded.model.norm.weight.device.type == "cpu" and loaded.compute in ("q4", "q8"):
        # The fused step reads f32, bf16 and int8 rows; fp8 is for GPUs (as vLLM offers it), where
        # it halves bf16's bytes, and runs on the CPU's Python paths too.
        raise ValueError(f"kv_cache_dtype fp8 runs on CUDA and on the CPU's f32 and int8 paths, not with this "
                         f"model's {loaded.compute} path on the CPU (its fused step reads f32, bf16 or int8 KV: "
                         "use int8 for a quarter of f32's bytes)")
    return KV_DTYPES[name]


def default_kv_budget() -> int:
    """A quarter of the machine's memory: room for the weights, the other models of a server, and
    the rest of the system (vLLM takes a share of the GPU's memory the same way)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
