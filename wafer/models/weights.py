"""Build a model (families.py) from a config and tensors named as in Hugging Face checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import torch

from wafer.models.config import ModelConfig
from wafer.models.families import new_model
from wafer.models.gemma3 import Gemma3Model
from wafer.models.llama import LlamaModel

# Tensors get fetched lazily by name so that a loader never holds two copies of the model.
TensorSource = Callable[[str], torch.Tensor | None]


def build_model(
    cfg: ModelConfig,
    get: TensorSource,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int], None] | None = None,
) -> LlamaModel | Gemma3Model:
    """Make the model on the meta device and assign real tensors, fusing QKV and gate/up."""
    with torch.device("meta"):
        model = new_model(cfg)

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise KeyError(name)
        return t.to(dtype)

    state: dict[str, torch.Tensor] = {}
    state["embed_tokens.weight"] = need("model.embed_tokens.weight")
    head = None if cfg.tie_word_embeddings else get("lm_head.weight")
    if head is None:
        cfg.tie_word_embeddings = True
        head = state["embed_tokens.weight"]
    state["lm_head.weight"] = head.to(dtype)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        attn = p + "self_attn."
        state[q + "self_attn.qkv_proj.weight"] = torch.cat([need(attn + f"{x}_proj.weight") for x in "qkv"])
        if cfg.attention_bias:
            state[q + "self_attn.qkv_proj.bias"] = torch.cat([need(attn + f"{x}_proj.bias") for x in "qkv"])
        state[q + "self_attn.o_proj.weight"] = need(attn + "o_proj.weight")
        mlp = p + "mlp."
        state[q + "mlp.gate_up_proj.weight"] = torch.cat([need(mlp + "gate_proj.weight"), need(mlp + "up_proj.weight")])
        state[q + "mlp.down_proj.weight"] = need(mlp + "down_proj.weight")
        if progress:
            progress(i + 1)
    for name, _ in model.named_parameters():
        if name.endswith("norm.weight"):  # each family's own set of norms, named as in its checkpoints
            state[name] = need("model." + name)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    return model

