"""Read a GGUF file: hyperparameters from its metadata, tensors dequantised by the `gguf` package."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from wafer.errors import ModelLoadError
from wafer.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves Q/K rows for its rotary kernel."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (used to write GGUF files in tests)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


@dataclass
class GGUFTokenizerData:
    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    extra_eos_ids: list[int] = field(default_factory=list)


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(str(path), "r")
        except Exception as e:  # the reader raises many kinds on a damaged file
            raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e
        self.meta: dict[str, Any] = {}
        for key, f in self.reader.fields.items():
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
                continue
            try:
                self.meta[key] = f.contents()
            except Exception:  # an odd field we do not use must not stop the load
                pass
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._by_hf_name = {hf_name(g): g for g in self.tensors if hf_name(g)}
        self.arch = self.meta.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: architecture {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self.config = self._config()
        self._check_extents()

    def _check_extents(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ModelLoadError(f"{self.path}: tensor {t.name} extends past the end of the file (truncated?)")

    def _config(self) -> ModelConfig:
        a = self.arch

        def key(name: str, default: Any = None) -> Any:
            return self.meta.get(f"{a}.{name}", default)

        try:
            n_heads = int(key("attention.head_count"))
            hidden = int(key("embedding_length"))
            n_tokens = len(self.reader.fields["tokenizer.ggml.tokens"].data)
            rope_scaling = None
            if key("rope.scaling.type") == "linear":
                rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
            freq = self.tensors.get("rope_freqs.weight")
            extra: dict[str, Any] = {}
            if freq is not None:
                extra["rope_freq_factors"] = torch.from_numpy(np.array(dequantize(freq.data, freq.tensor_type)).copy())
            qtype = self.meta.get("general.file_type")
            return ModelConfig(
                arch=a,
                vocab_size=int(key("vocab_size", n_tokens)),
                hidden_size=hidden,
                intermediate_size=int(key("feed_forward_length")),
                num_layers=int(key("block_count")),
                num_heads=n_heads,
                num_kv_heads=int(key("attention.head_count_kv", n_heads)),
                head_dim=int(key("attention.key_length", hidden // n_heads)),
                max_position_embeddings=int(key("context_length", 4096)),
                rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(key("rope.freq_base", 10000.0)),
                rope_scaling=rope_scaling,
                attention_bias="blk.0.attn_q.bias" in self.tensors,
                tie_word_embeddings="output.weight" not in self.tensors,
                sliding_window=key("attention.sliding_window"),
                name=str(self.meta.get("general.name", self.path.stem)),
                quantization=_file_type_name(qtype, self.reader),
                extra=extra,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: GGUF metadata is missing or invalid ({e})") from e

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor under its Hugging Face name, dequantised to float32."""
        gname = self._by_hf_name.get(name)
        if gname is None:
            return None
        t = self.tensors[gname]
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {gname} has unsupported type {t.tensor_type.name}") from e
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: F32 tensors are read-only views of the file
        if self.arch == "llama" and (gname.endswith("attn_q.weight") or gname.endswith("attn_q.bias")):
            w = unpermute_rope(w, self.config.num_heads)
        elif self.arch == "llama" and (gname.endswith("attn_k.weight") or gname.endswith("attn_k.bias")):
            w = unpermute_rope(w, self.config.num_kv_heads)
        return w

    def tokenizer_data(self) -> GGUFTokenizerData:
        f = self.reader.fields

        def strings(name: str) -> list[str]:
            field_ = f.get(name)
            return list(field_.contents()) if field_ is not None else []

        types = f.get("tokenizer.ggml.token_type")
        m = self.meta
        return GGUFTokenizerData(
            model=m.get("tokenizer.ggml.model", "gpt2"),
            pre=m.get("tokenizer.ggml.pre"),
            tokens=strings("tokenizer.ggml.tokens"),
            token_types=[int(x) for x in types.contents()] if types is not None else [],
            merges=strings("tokenizer.ggml.merges"),
            bos_id=m.get("tokenizer.ggml.bos_token_id"),
            eos_id=m.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(m.get("tokenizer.ggml.add_bos_token", m.get("tokenizer.ggml.model") == "llama")),
            chat_template=m.get("tokenizer.chat_template"),
            extra_eos_ids=[int(m["tokenizer.ggml.eot_token_id"])] if "tokenizer.ggml.eot_token_id" in m else [],
        )


def _file_type_name(file_type: Any, reader: GGUFReader) -> str:
    """The dominant weight type, e.g. 'Q4_1' (the file_type code is not always present)."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    if counts:
        return max(counts, key=lambda k: counts[k])
    return GGMLQuantizationType(file_type).name if file_type is not None else "unknown"
