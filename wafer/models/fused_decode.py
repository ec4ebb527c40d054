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
    def __init__(self, model: LlamaModel, ext, weights: list[list[torch.Tensor]], head: list[torch.Tensor]) -> None:
        self.model = model
        self.ext = ext
        self.weights = weights
        self.head = head
        self._with_caches: tuple[int, list[torch.Tensor]] | None = None
        cfg = model.config
        self.args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.rms_norm_eps), cfg.sliding_window or 0)

    @classmethod
    def build(cls, model: LlamaModel) -> FusedDecode | None:
        """None unless every linear layer runs on wafer's block kernels (the q4 path)."""
        ext = kernels()
        if ext is None:
            return None
        head = _linear(model.lm_head, 8)
        weights = []
        for layer in model.layers:
            parts = [_linear(layer.self_attn.qkv_proj, 4), _linear(layer.self_attn.o_proj, 4),
                     _linear(layer.mlp.gate_up_proj, 4), _linear(layer.mlp.down_proj, 4)]
            if head is None or any(p is None for p in parts):
                return None
            weights.append([layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                            *[t for p in parts for t in p]])  # type: ignore[union-attr]
        return cls(model, ext, weights, head)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [M, vocab] for M tokens, each at its own (slot, position)."""
        if self._with_caches is None or self._with_caches[0] != id(caches):
            flat = [t for w, (k, v) in zip(self.weights, caches) for t in (*w, k, v)]
            self._with_caches = (id(caches), flat)
        rotary = self.model.rotary
        x = self.model.embed_tokens(input_ids)
        return self.ext.decode_step(x, positions, slots, rotary.cos, rotary.sin, self._with_caches[1],
                                    self.model.norm.weight.detach(), self.head, *self.args)
