"""Gemma 3's text model (270M to 27B): the second family wafer runs, beside llama.py's.

It differs from the Llama block in ways that change the numbers, each checked against
transformers' modeling_gemma3.py: embeddings scaled by sqrt(hidden); four RMSNorms per block
(around attention and around the MLP, not only before them); an RMSNorm over each query and key
head before RoPE; a GeGLU MLP (tanh-approximated GELU); queries scaled by query_pre_attn_scalar**-0.5;
and two kinds of layer: windowed ones (window `sliding_window`, RoPE base 10,000, never scaled) and
global ones (RoPE base `rope_theta`, with the file's RoPE scaling), five of the first to one of
the second. Norm weights are used as stored: llama.cpp's converter folds Gemma's (1 + weight) into
the GGUF's norm tensors (transformers' GGUF loader subtracts the 1 again for its own RMSNorm).

Module names follow llama.py's (fused qkv_proj and gate_up_proj) so that the loaders, the q4/q8
block path and the fused C++ step (kernels/fused_decode.py, which takes this block's extra norms,
GeGLU and second RoPE base) treat both families alike.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from wafer.models.attention import AttentionBatch, attend
from wafer.models.config import ModelConfig
from wafer.models.llama import RMSNorm, Rotary, rope_inv_freq

LOCAL_ROPE_THETA = 10_000.0  # transformers' and llama.cpp's base for windowed layers


class Gemma3Rotary(nn.Module):
    """cos and sin made from the positions at each step: a table of the 32K-token context for both
    bases would take 128 MB at head dim 256, more than the 270M model's layers in 4 bits."""

    def __init__(self, cfg: ModelConfig, local: bool) -> None:
        super().__init__()
        if local:
            cfg = dataclasses.replace(cfg, rope_theta=float(cfg.extra.get("rope_local_theta", LOCAL_ROPE_THETA)),
                                      rope_scaling=None, extra={})
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.dtype).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.split = (q_dim, kv_dim, kv_dim)
        self.scale = float(cfg.extra.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = Rotary.apply(self.q_norm(q.view(n, self.n_heads, self.head_dim)), *rope)
        k = Rotary.apply(self.k_norm(k.view(n, self.n_kv, self.head_dim)), *rope)
        o = attend(q, k, v.view(n, self.n_kv, self.head_dim), cache[0], cache[1], batch, self.scale, self.window)
        return self.o_proj(o.view(n, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Block(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Given its (empty) weight, the embedding skips its random init (see LlamaModel).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Gemma3Block(cfg, window) for window in cfg.windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.device("cpu"):  # real buffers even when the model is made on the meta device to be loaded
            # float32 like transformers' buffer, rounded to the activations' dtype when applied
            self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
            self.rotary = Gemma3Rotary(cfg, local=False)
            self.rotary_local = Gemma3Rotary(cfg, local=True)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices) or N, vocab] for a flat batch of N tokens."""
        h = self.embed_tokens(input_ids)
        h = h * self.embed_scale.to(h.dtype)
        ropes = {False: self.rotary.tables(positions), True: self.rotary_local.tables(positions)}
        for layer, cache in zip(self.layers, caches):
            rope = ropes[layer.self_attn.window is not None]
            h = h + layer.post_attention_layernorm(layer.self_attn(layer.input_layernorm(h), rope, cache, batch))
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        if logits_indices is not None:
            h = h[logits_indices]
        return self.lm_head(self.norm(h)).float()
