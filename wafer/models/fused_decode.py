"""A whole model step in one call of wafer's C++ (csrc/decode.h), for the `q4` and `q8` compute paths.

The Python model stays the definition and the reference: this only gathers its weights (the block
codes of every BlockLinear, the norms, the rotary tables) once, and the runner uses it for every
step of these paths: decodes, draft verification and prompt chunks. Each token's arithmetic there
is its own (its activations' quantisation, its attention over its slot up to its position), so a
token's logits and KV entries do not depend on what else the step holds: a prompt gives bitwise the
same answer whole or chunked, cached or not, alone or batched, with or without speculation. Other
compute paths and WAFER_KERNELS=off run the Python model.
"""

from __future__ import annotations

from types import ModuleType

import torch

from wafer.models.kernels import kernels
from wafer.models.llama import LlamaModel
from wafer.models.quant import BlockLinear

def _linear(mod: object) -> list[torch.Tensor] | None:
    if not isinstance(mod, BlockLinear):
        return None
    return [mod.packed, mod.bias.detach() if mod.bias is not None else torch.empty(0)]


class FusedDecode:
    def __init__(self, model: LlamaModel, ext, tensors: list[torch.Tensor], out_features: list[int]) -> None:
        self.model = model
        self.ext = ext
        self.tensors = tensors  # per layer: its weights, then its K and V caches; then the head
        self.out_features = out_features
        cfg = model.config
        self.args = (float(cfg.rms_norm_eps), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window or 0)

    @classmethod
    def build(cls, model: LlamaModel, caches: list[tuple[torch.Tensor, torch.Tensor]],
              ext: ModuleType | None = None) -> FusedDecode | None:
        """For the model and its KV cache, on the active kernel variant or `ext` (one of
        kernels.load()'s); None unless every linear layer runs on wafer's block kernels (the q4 and
        q8 paths)."""
        ext = ext or kernels()
        if ext is None or not isinstance(model, LlamaModel):  # the C++ step is the Llama block (Gemma 3 is not)
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
            flat += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                     *[t for p in parts for t in p], k_cache, v_cache]  # type: ignore[union-attr]
            out_features += [mod.out_features for mod in mods]
        if model.lm_head is not None:
            out_features.append(model.lm_head.out_features)
        return cls(model, ext, flat + head, out_features)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(rows), vocab] for those of M tokens, each at its own (slot, position); the
        caches are pools of blocks, and `tables` [slots, max_blocks] lists each slot's blocks. A
        pipeline stage goes on from `hidden`, and without a head returns hidden states [M, hidden]."""
        rotary = self.model.rotary
        x = self.model.embed_tokens(input_ids) if hidden is None else hidden
        return self.ext.decode_step(x, positions, slots, rotary.cos, rotary.sin, tables, self.tensors, self.out_features,
                                    self.model.norm.weight.detach(), *self.args, rows)
