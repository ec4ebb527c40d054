"""Read a GGUF file: hyperparameters from its metadata; tensors as the file holds them, or dequantised by\nthe `gguf` package."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from wafer.errors import ModelLoadError
from wafer.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from wafer.models.gguf_blocks import AS_FLOAT, dequantize_f32
from wafer.models.gguf_reader import GGUFHeader, TensorInfo

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
# Gemma 3 names its four block norms and its QK norms on top of these; its ffn_norm comes before
# the MLP as in Llama, but Llama calls that one post_attention_layernorm.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
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
    add_space_prefix: bool = True  # sentencepiece's dummy prefix ("▁" before the text); Gemma has none


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.header = GGUFHeader(path)
        except Exception as e:  # a damaged header fails in many ways
            raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e
        self.fields = self.header.fields
        skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
        self.meta: dict[str, Any] = {k: v for k, v in self.fields.items() if k not in skip}
        self.tensors = {t.name: t for t in self.header.tensors}
        self._map: mmap.mmap | None = None
        self.arch = self.meta.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: architecture {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        named = ((hf_name(g, self.arch), g) for g in self.tensors)
        self._by_hf_name = {h: g for h, g in named if h}
        self.config = self._config()
        self._check_extents()

    def _check_extents(self) -> None:
        size = self.path.stat().st_size
        for t in self.header.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"{self.path}: tensor {t.name} extends past the end of the file (truncated?)")

    def _config(self) -> ModelConfig:
        a = self.arch

        def key(name: str, default: Any = None) -> Any:
            return self.meta.get(f"{a}.{name}", default)

        try:
            n_heads = int(key("attention.head_count"))
            hidden = int(key("embedding_length"))
            n_tokens = len(self.fields["tokenizer.ggml.tokens"])
            rope_scaling = None
            if key("rope.scaling.type") == "linear":
                rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
            freq = self.tensors.get("rope_freqs.weight")
            extra: dict[str, Any] = {}
            if freq is not None:
                extra["rope_freq_factors"] = torch.from_numpy(
                    np.array(dequantize(self.header.data(freq), freq.tensor_type), dtype=np.float32).reshape(-1))
            qtype = self.meta.get("general.file_type")
            layer_windows = None
            if a == "gemma3":
                layer_windows = self._gemma3_layers(extra, int(key("block_count")), hidden, n_heads)
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
                layer_windows=layer_windows,
                name=str(self.meta.get("general.name", self.path.stem)),
                quantization=_file_type_name(qtype, self.header.tensors),
                extra=extra,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: GGUF metadata is missing or invalid ({e})") from e

    def _gemma3_layers(self, extra: dict[str, Any], n_layers: int, hidden: int, n_heads: int) -> list[int | None]:
        """Gemma 3's per-layer windows, and in `extra` what its file leaves to the reader's
        knowledge: the windowed layers' RoPE base and the query scaling (llama.cpp's rules)."""
        a = self.arch
        window = self.meta.get(f"{a}.attention.sliding_window")
        if window is None:
            raise KeyError(f"{a}.attention.sliding_window")
        pattern = self.meta.get(f"{a}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer converters: one flag per layer, True where windowed
            windowed = [bool(x) for x in pattern]
        else:  # every `pattern`-th layer is global (transformers' sliding_window_pattern)
            windowed = [(i + 1) % int(pattern) != 0 for i in range(n_layers)]
        extra["rope_local_theta"] = float(self.meta.get(f"{a}.rope.freq_base_swa", 10000.0))
        # The 27B model (62 layers) scales queries by hidden / heads, the others by the head dim.
        head_dim = int(self.meta.get(f"{a}.attention.key_length", hidden // n_heads))
        extra["query_pre_attn_scalar"] = hidden / n_heads if n_layers == 62 else float(head_dim)
        return [int(window) if w else None for w in windowed]

    def raw(self, name: str) -> tuple[torch.Tensor, GGMLQuantizationType, int] | None:
        """The tensor under its Hugging Face name as the file holds it: (bytes [rows, row bytes]
        viewed in place in a mapping of the file, its type, its row length in elements)."""
        gname = self._by_hf_name.get(name)
        if gname is None:
            return None
        t = self.tensors[gname]
        raw = self._bytes(t)
        if self.arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config.num_heads if "attn_q" in gname else self.config.num_kv_heads
            raw = unpermute_rope(raw, heads)  # rows are whole in each block type: they move as bytes
        return raw, t.tensor_type, int(t.shape[0])

    def _bytes(self, t: TensorInfo) -> torch.Tensor:
        """A tensor's bytes [rows, row bytes], viewed in place in a mapping of the file."""
        if self._map is None:
            with open(self.path, "rb") as fh:  # a private mapping: writable views, nothing written back
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=int(t.n_bytes), offset=int(t.data_offset))
        return raw.view(rows, -1)

    def release(self, name: str) -> None:
        """Drop a tensor's pages of the file from this process's memory once they are converted
        (the page cache keeps them; a later read maps them again)."""
        gname = self._by_hf_name.get(name)
        if gname is None or self._map is None:
            return
        t = self.tensors[gname]
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(t.data_offset) + int(t.n_bytes)
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, (end - start) // mmap.PAGESIZE * mmap.PAGESIZE)
        except (AttributeError, OSError, ValueError):
            pass  # not on this system: the pages stay until the file is closed

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor under its Hugging Face name, dequantised to float32."""
        gname = self._by_hf_name.get(name)
        if gname is None:
            return None
        t = self.tensors[gname]
        shape = tuple(reversed(t.shape))
        if t.tensor_type in AS_FLOAT:
            w = dequantize_f32(self._bytes(t), t.tensor_type).reshape(shape)
        else:
            try:
                arr = dequantize(self.header.data(t), t.tensor_type)
            except NotImplementedError as e:
                raise ModelLoadError(f"{self.path}: tensor {gname} has unsupported type {t.tensor_type.name}") from e
            # a copy (F32 tensors are read-only views of the file), in the tensor's shape
            w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        if self.arch == "llama" and (gname.endswith("attn_q.weight") or gname.endswith("attn_q.bias")):
            w = unpermute_rope(w, self.config.num_heads)
        elif self.arch == "llama" and (gname.endswith("attn_k.weight") or gname.endswith("attn_k.bias")):
            w = unpermute_rope(w, self.config.num_kv_heads)
        return w

    def tokenizer_data(self) -> GGUFTokenizerData:
        f = self.fields
        m = self.meta
        return GGUFTokenizerData(
            model=m.get("tokenizer.ggml.model", "gpt2"),
            pre=m.get("tokenizer.ggml.pre"),
            tokens=list(f.get("tokenizer.ggml.tokens", [])),
            token_types=[int(x) for x in f.get("tokenizer.ggml.token_type", [])],
            merges=list(f.get("tokenizer.ggml.merges", [])),
            bos_id=m.get("tokenizer.ggml.bos_token_id"),
            eos_id=m.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(m.get("tokenizer.ggml.add_bos_token", m.get("tokenizer.ggml.model") == "llama")),
            chat_template=m.get("tokenizer.chat_template"),
            extra_eos_ids=[int(m["tokenizer.ggml.eot_token_id"])] if "tokenizer.ggml.eot_token_id" in m else [],
            add_space_prefix=bool(m.get("tokenizer.ggml.add_space_prefix", True)),
        )

    def scores(self) -> list[float] | None:
        s = self.fields.get("tokenizer.ggml.scores")
        return [float(x) for x in s] if s is not None else None


def _file_type_name(file_type: Any, tensors: list[TensorInfo]) -> str:
    """The dominant weight type, e.g. 'Q4_1' (the file_type code is not always present)."""
    counts: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    if counts:
        return max(counts, key=lambda k: counts[k])
    return GGMLQuantizationType(file_type).name if file_type is not None else "unknown"
