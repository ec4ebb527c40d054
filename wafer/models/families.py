"""Which model definition runs each architecture of SUPPORTED_ARCHITECTURES."""

from __future__ import annotations

from torch import nn

from wafer.models.config import ModelConfig
from wafer.models.gemma3 import Gemma3Model
from wafer.models.llama import LlamaModel


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return Gemma3Model if cfg.arch == "gemma3" else LlamaModel


def new_model(cfg: ModelConfig) -> LlamaModel | Gemma3Model:
    """The architecture's model, uninitialised (its loader assigns every weight)."""
    return model_class(cfg)(cfg)  # type: ignore[return-value]
