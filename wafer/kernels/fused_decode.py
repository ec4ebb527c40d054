"""A whole model step in one call of wafer's C++ (csrc/decode.h), for the `q4` and `q8` compute paths.

The Python model stays the definition and the reference: this only gathers its weights (the block
codes of every BlockLinear, the norms, the rotary tables) once, and the runner uses it for every
step of these paths: decodes, draft verification and prompt chunks. Each token's arithmetic there
is its own (its activations' quantisation, its attention over its slot up to its position), so a
token's logits and KV entries do not depend on what else the step holds: a prompt gives bitwise the
same answer whole or chunked, cached or not, alone or batched, with or without speculation. Other
compute paths and WAFER_KERNELS=off run the Python model. Both families run here: the Llama
block, and Gemma 3's (its head and output norms, GeGLU, and two RoPE bases) by the same step.
"""

from __future__ import annotations

from types import ModuleType

import torch

from wafer.models.gemma3 import Gemma3Block, Gemma3Model
from wafer.kernels.build import kernels
from wafer.models.llama import LlamaModel
from wafer.models.quant import BlockLinear


def _linear(mod: object) -> list[torch.Tensor] | None:
    if not isinstance(mod, BlockLinear):
        return None
    return [mod.packed, mod.bias.detach() if mod.bias is not None else torch.empty(0)]


def _norms(layer: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A block's norm weights as the C++ step takes them: the two before attention and before the
    MLP, and Gemma 3's four more (query and key heads, attention and MLP outputs)."""
    if isinstance(layer, Gemma3Block):
        attn = layer.self_attn
        return ([layer.input_layernorm.weight, layer.pre_feedforward_layernorm.weight],
                [attn.q_norm.weight, attn.k_norm.weight, layer.post_attention_layernorm.weight,
                 layer.post_feedforward_layernorm.weight])
    return [layer.input_layernorm.weight, layer.post_attention_layernorm.weight], []


class FusedDecode:
    def __init__(self, model: LlamaModel | Gemma3Model, ext: ModuleType, tensors: list[torch.Tensor],
                 out_features: list[int], groups: list[int]) -> None:
        """tensors: per layer its weights, then its K and V pools (then Gemma's norms); then the head's."""
        self.model = model
        cfg = model.config
        self.gemma = isinstance(model, Gemma3Model)
        windows = [layer.self_attn.window or 0 for layer in model.layers]  # a pipeline stage's own layers
        local = [int(self.gemma and w > 0) for w in windows]  # Gemma 3's windowed layers take the local base
        scale = model.layers[0].self_attn.scale if len(model.layers) else cfg.head_dim**-0.5
        # Checked and held in C++ once: the step then takes only what changes from step to step.
        self.layers = ext.Model(tensors, out_features, model.norm.weight.detach(), float(cfg.rms_norm_eps),
                                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, windows, local, groups,
                                16 if self.gemma else 12, self.gemma, float(scale))

    @classmethod
    def build(cls, model: LlamaModel | Gemma3Model, caches: list[tuple[torch.Tensor, torch.Tensor]],
              groups: list[int], ext: ModuleType | None = None) -> FusedDecode | None:
        """For the model and its KV cache (each layer's pools, and its group of the cache's tables:
        BlockManager.layer_group), on the active kernel variant or `ext` (one of kernels.load()'s); None
        unless every linear layer runs on wafer's block kernels (the q4 and q8 paths)."""
        ext = ext or kernels()
        if ext is None or not isinstance(model, (LlamaModel, Gemma3Model)):
            return None
        # A pipeline stage before the last has no head: the step returns its hidden states.
        head = _linear(model.lm_head) if model.lm_head is not None else []
        flat: list[torch.Tensor] = []
        out_features: list[int] = []
        for layer, (k_cache, v_cache) in zip(model.layers, caches):
            mods = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
            parts = [_linear(mod) for mod in mods]
            if head is None or any(p is None for p in parts):
                return None
            before, extra = _norms(layer)
            flat += [w.detach() for w in before] + [t for p in parts for t in p] + [k_cache, v_cache]  # type: ignore[union-attr]
            flat += [w.detach() for w in extra]
            out_features += [mod.out_features for mod in mods]
        if model.lm_head is not None:
            out_features.append(model.lm_head.out_features)
        return cls(model, ext, flat + head, out_features, list(groups))

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor | None = None,
                 remap: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(rows), vocab] for those of M tokens, each at its own (slot, position); the
        caches are pools of blocks, and `tables` [groups, slots, max_blocks] lists each slot's blocks. A
        pipeline stage goes on from `hidden`, and without a head returns hidden states [M, hidden].
        `remap` [M, width]: draft trees' nodes, whose paths' KV rows lie elsewhere than their
        positions say (ModelRunner._prepare_fused)."""
        model = self.model
        none = torch.empty(0)
        if self.gemma:
            # Gemma's angles are made for the step's positions (a 32K table of both bases would
            # outweigh the 270M model), the same way its Python forward makes them.
            x = model.embed_tokens(input_ids) if hidden is None else hidden
            if hidden is None:
                x = x * model.embed_scale.to(x.dtype)
            n = positions.numel()
            cos, sin = (t.reshape(n, -1) for t in model.rotary.tables(positions))
            cos_l, sin_l = (t.reshape(n, -1) for t in model.rotary_local.tables(positions))
            rope = (cos, sin, cos_l, sin_l, torch.arange(n))
        else:
            x = model.embed_tokens(input_ids) if hidden is None else hidden
            rope = (model.rotary.cos, model.rotary.sin, none, none, none)
        return self.layers.step(x, positions, slots, *rope, tables, rows, none if remap is None else remap)
