"""Tiny models for tests, built with transformers and saved in the real formats."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from wafer.models.gguf_loader import permute_rope
from wafer.models.loader import default_model_path

Q = GGMLQuantizationType


@lru_cache(maxsize=1)
def hf_tokenizer():
    from transformers import AutoTokenizer

    p = default_model_path()
    with _plain_mapping():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


class _PlainMapping:
    """numpy as gguf's reader sees it, but with np.memmap giving a plain ndarray over the same
    mapping: the reader and transformers slice the file millions of times for a large vocabulary,
    and each slice of a memmap runs its Python-level __getitem__ and __array_finalize__ (about 60%
    of a parse). Same bytes, same mapping."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


@contextmanager
def _plain_mapping() -> Iterator[None]:
    """gguf's reader, while inside, maps files as plain ndarrays (_PlainMapping)."""
    import gguf.gguf_reader

    gguf.gguf_reader.np = _PlainMapping()  # type: ignore[assignment]
    try:
        yield
    finally:
        gguf.gguf_reader.np = np


def gguf_reader(path: Path | str) -> GGUFReader:
    """gguf's own reader of a file, parsed over a plain view of its mapping: the same fields and
    tensors, in a third of the time for a large vocabulary."""
    with _plain_mapping():
        return GGUFReader(str(path))


def hf_from_gguf(path: Path):
    """transformers' own float32 load of a GGUF file: the reference. transformers parses the file's
    metadata twice (for the config, then for the weights), and for a vocabulary of 150k to 260k
    tokens each parse takes 10-20 s in Python on two cores; one parse serves both here, over a plain
    view of the mapping (_PlainMapping)."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = Path(path)
    parse = gguf.GGUFReader
    cached = lru_cache(maxsize=1)(parse)
    gguf.GGUFReader = cached
    try:
        with _plain_mapping():
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                        dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader = parse
        cached.cache_clear()


def make_hf_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random model with SmolLM2's vocabulary, saved as safetensors with tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    kwargs = dict(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2,
    )
    if arch == "llama":
        kwargs["rope_theta"] = 10000.0
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).float().eval()
    if arch == "qwen2":  # random biases, so that a dropped bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    hf_tokenizer().save_pretrained(out)
    return out


def with_generation_config(hf_dir: Path, out: Path, config: dict) -> Path:
    """A copy of the model in `hf_dir` with `config` as its generation_config.json."""
    import json
    import shutil

    shutil.copytree(hf_dir, out)
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def _quantised(arr: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        # The gguf package cannot quantise to K-quants; random blocks with sane scales are valid.
        from gguf.constants import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[qtype]
        rows, cols = arr.shape
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        scale = np.full((rows, cols // block), 0.002, dtype=np.float16).view(np.uint8).reshape(rows, cols // block, 2)
        if qtype == Q.Q6_K:  # d is the last two bytes
            raw[..., -2:] = scale
        else:  # d and dmin are the first four bytes
            raw[..., 0:2] = scale
            raw[..., 2:4] = scale
        return raw.reshape(rows, -1)
    return quantize(arr, qtype)


@lru_cache(maxsize=1)
def _smollm_tokenizer_fields() -> dict:
    f = gguf_reader(default_model_path()).fields
    keys = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges", "tokenizer.chat_template"]
    return {k: f[k].contents() for k in keys}


def hf_to_gguf(hf_dir: Path, out: Path, qtype: GGMLQuantizationType = Q.F32, seed: int = 0,
               kv: dict[str, float | int] | None = None) -> Path:
    """Write the model in `hf_dir` as GGUF the way llama.cpp's converter lays it out; `kv`: more
    metadata (ints as int32 and floats as float32, as llama.cpp writes general.sampling.*)."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = "qwen2" if cfg["model_type"] == "qwen2" else "llama"
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // n_heads)
    w.add_vocab_size(cfg["vocab_size"])
    f = _smollm_tokenizer_fields()
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(f["tokenizer.chat_template"])
    for key, value in (kv or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)
    rng = np.random.default_rng(seed)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                   "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                   "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                   "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                   "self_attn.v_proj.bias": "attn_v.bias",
                   "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                   "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in state.items():
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{layer_names[rest]}"
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            t = permute_rope(t, n_heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            t = permute_rope(t, n_kv)
        arr = t.float().numpy()
        if arr.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, _quantised(arr, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# A chat template with a thinking switch, as Qwen3's: thinking is on unless `enable_thinking` is false,
# which closes an empty thought in the prompt; past assistant turns lose their thoughts.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def with_chat_template(hf_dir: Path, out: Path, template: str) -> Path:
    """A copy of the model in `hf_dir` whose tokenizer_config.json carries `template`."""
    import json
    import shutil

    shutil.copytree(hf_dir, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return out
