"""A whole decode step in one call of wafer's C++ (csrc/decode.cpp), for the `q4` compute path.

The Python model stays the definition and the reference: this only gathers its weights (the block
codes of every BlockLinear, the norms, the rotary tables) once, and the runner uses it for steps of
at most MAX_ROWS tokens (decode steps, draft verification, short prompt chunks). Anything larger,
other compute paths and CPUs without the kernels run the Python model.
"""

from __future__ import annotations

import torch

from wafer.models.blockquant import kernels
from wafer.models.llama import LlamaModel
from wafer.models.quant import BlockLinear

MAX_ROWS = 32  # as BlockLinear: from 32 rows on, dense float32 matrices are faster than the block kernels


def _linear(mod: object, bits: int) -> list[torch.Tensor] | None:
    if not isinstance(mod, BlockLinear) or mod.bits != bits:
        return None
    empty = torch.empty(0)
    return [mod.codes, mod.scales, mod.mins if mod.mins is not None else empty,
            mod.bias.detach() if mod.bias is not None else empty]


class FusedDecode:
    def __init__(self, model: LlamaModel, ext, layers: list[torch.Tensor], head: list[torch.Tensor]) -> None:
        self.model = model
        self.ext = ext
        self.layers = layers  # per layer: its weights, then its K and V caches
        self.head = head
        cfg = model.config
        self.args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.rms_norm_eps), cfg.sliding_window or 0)

    @classmethod
    def build(cls, model: LlamaModel, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> FusedDecode | None:
        """For the model and its KV cache; None unless every linear layer runs on wafer's block
        kernels (the q4 path)."""
        ext = kernels()
        if ext is None:
            return None
        head = _linear(model.lm_head, 8)
        flat: list[torch.Tensor] = []
        for layer, (k_cache, v_cache) in zip(model.layers, caches):
            parts = [_linear(layer.self_attn.qkv_proj, 4), _linear(layer.self_attn.o_proj, 4),
                     _linear(layer.mlp.gate_up_proj, 4), _linear(layer.mlp.down_proj, 4)]
            if head is None or any(p is None for p in parts):
                return None
            flat += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                     *[t for p in parts for t in p], k_cache, v_cache]  # type: ignore[union-attr]
        return cls(model, ext, flat, head)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Logits [M, vocab] for M tokens, each at its own (slot, position)."""
        rotary = self.model.rotary
        x = self.model.embed_tokens(input_ids)
        return self.ext.decode_step(x, positions, slots, rotary.cos, rotary.sin, self.layers,
                                    self.model.norm.weight.detach(), self.head, *self.args)
