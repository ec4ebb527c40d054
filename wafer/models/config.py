"""Hyperparameters of a Llama-family model, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures served by llama.py's model definition, and gemma3 by gemma3.py's (families.py).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Per-layer attention windows where layers differ (Gemma 3: five windowed layers to one global);
    # None means every layer uses `sliding_window`.
    layer_windows: list[int | None] | None = None
    name: str = ""
    quantization: str = "f32"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def windows(self) -> list[int | None]:
        """The attention window of each layer (None: the whole context)."""
        return list(self.layer_windows) if self.layer_windows is not None else [self.sliding_window] * self.num_layers
