"""The Llama family in one definition: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5.

Weights are stored fused (one QKV matrix, one gate/up matrix) so that a decode step reads each
layer with three matrix calls instead of seven. Tokens arrive flat ([N]) with their positions and
cache slots, so a batch of sequences of any lengths is one forward pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from wafer.models.attention import AttentionBatch, attend
from wafer.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    freq_factors = cfg.extra.get("rope_freq_factors")
    if freq_factors is not None:  # GGUF files carry Llama 3 scaling as per-frequency divisors
        inv_freq = inv_freq / freq_factors
    return inv_freq


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [N, 1, D]: gathered once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, D]; rotate-half convention (GGUF Llama weights are un-permuted at load).
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.split = (q_dim, kv_dim, kv_dim)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q_and_k, v = qkv.split((self.split[0] + self.split[1], self.split[2]), dim=-1)
        # Q and K are adjacent in the fused projection: rotate them in one pass.
        qk = Rotary.apply(q_and_k.view(n, self.n_heads + self.n_kv, self.head_dim), *rope)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = v.view(n, self.n_kv, self.head_dim)
        o = attend(q, k, v, cache[0], cache[1], batch, self.scale, self.window)
        return self.o_proj(o.view(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Given its (empty) weight, the embedding skips its random init: loaders assign every weight,
        # and on the meta device that init imports torch._dynamo (0.7 s of every start-up).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, window) for window in cfg.windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.device("cpu"):  # real tables even when the model is made on the meta device to be loaded
            self.rotary = Rotary(cfg)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices) or N, vocab] for a flat batch of N tokens. A pipeline stage's
        model (stage.py) holds some of the layers: without the embedding it goes on from the previous
        stage's `hidden` states, and without the head it returns its own [N, hidden]."""
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        rope = self.rotary.tables(positions)
        for layer, cache in zip(self.layers, caches):
            h = h + layer.self_attn(layer.input_layernorm(h), rope, cache, batch)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if self.lm_head is None:
            return h
        if logits_indices is not None:
            h = h[logits_indices]
        return self.lm_head(self.norm(h)).float()
