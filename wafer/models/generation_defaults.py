"""The sampling defaults a model comes with: what a request gets for a parameter it leaves out.

As vLLM's `--generation-config auto` does, from the model where it says: a Hugging Face directory's
generation_config.json, or a GGUF's `general.sampling.*` metadata (written by recent llama.cpp
converters). Where the file says nothing, RECOMMENDED below holds what a model's authors recommend
on its card. wafer.toml may override them per model, and a request's own values always win.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("wafer.models")

# What sampling is without defaults (OpenAI's temperature and top_p of 1; top_k 0 is off).
NEUTRAL: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

# For models whose files carry no defaults, keyed by their name lower-cased (see `_names`).
RECOMMENDED: dict[str, dict[str, float]] = {
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (the bundled model): the card's
    # example generates with `temperature=0.2, top_p=0.9, do_sample=True`.
    "smollm2-135m-instruct": {"temperature": 0.2, "top_p": 0.9},
    # https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct: their
    # generation_config.json (Qwen's small instruct models: repetition penalty 1.1, not 1.05).
    "qwen2.5-coder-1.5b-instruct": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1},
    "qwen2.5-coder-0.5b-instruct": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1},
}

# gguf.constants.Keys.General.SAMPLING_* (gguf 0.19): llama.cpp's names for the same settings.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

# The ranges a request may use (server/protocol.py), so that a default is never one it could not send.
_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (-1, 2**31 - 1), "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-9, 10.0),
}
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|bf16|fp16|f16|f32)$", re.IGNORECASE)


def check(values: Mapping[str, Any]) -> dict[str, float]:
    """`values` validated: known keys, numbers in the ranges a request may use. Raises ValueError."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key not in NEUTRAL:
            raise ValueError(f"unknown sampling parameter {key!r} (known: {', '.join(NEUTRAL)})")
        integral = key == "top_k"
        # bool is an int to Python, but `temperature = true` is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise ValueError(f"{key} must be {'an integer' if integral else 'a number'}, got {value!r}")
        low, high = _RANGES[key]
        if not low <= value <= high:
            raise ValueError(f"{key} must be between {low:g} and {high:g}, got {value!r}")
        out[key] = int(value) if integral else float(value)
    return out


def _valid(raw: Mapping[str, Any], where: str) -> dict[str, float]:
    """What a model file says, less what a request could not send (logged: a bad value in a
    downloaded file must not stop the model from loading)."""
    out: dict[str, float] = {}
    for key, value in raw.items():
        if value is None:
            continue
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            out.update(check({key: value}))
        except ValueError as e:
            log.warning("%s: ignoring sampling default: %s", where, e)
    return out


def from_hf_dir(path: Path) -> dict[str, float]:
    """generation_config.json's sampling settings. `do_sample` is ignored as vLLM ignores it: many
    files set `do_sample: false` beside the temperature their authors mean to be sampled at."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        log.warning("%s: not valid JSON (%s); no sampling defaults from it", file, e)
        return {}
    return _valid({k: raw[k] for k in NEUTRAL if k in raw}, str(file)) if isinstance(raw, dict) else {}


def from_gguf(meta: Mapping[str, Any], where: str = "GGUF") -> dict[str, float]:
    return _valid({key: meta[g] for g, key in _GGUF_KEYS.items() if g in meta}, where)


def _names(name: str, path: Path) -> list[str]:
    """What RECOMMENDED is looked up by: the name served, and the file's name less a quantisation
    suffix (SmolLM2-135M-Instruct.Q4_1.gguf -> smollm2-135m-instruct). Not a GGUF's general.name,
    which converters fill from other fields (the bundled file's: 'Smollm2 135M 8k Lc100K Mix1 Ep2')."""
    stem = path.name if path.is_dir() else path.stem
    return [n.lower() for n in (name, stem, _QUANT_SUFFIX.sub("", stem))]


def recommended(name: str, path: Path) -> dict[str, float]:
    return next((dict(RECOMMENDED[n]) for n in _names(name, path) if n in RECOMMENDED), {})


def model_defaults(name: str, path: Path,
                   gguf_meta: Mapping[str, Any] | None = None) -> tuple[dict[str, float], str]:
    """The defaults of the model served as `name` from `path` (a Hugging Face directory, or a GGUF
    file with its metadata), only those it sets, and where they come from: the file's own values
    over the recommended ones, key by key."""
    if gguf_meta is not None:
        own, source = from_gguf(gguf_meta, str(path)), "GGUF metadata"
    else:
        own, source = from_hf_dir(path), "generation_config.json"
    card = recommended(name, path)
    sources = [s for s, d in ((source, own), ("wafer's table of model cards", card)) if d]
    return {**card, **own}, " over ".join(sources) or "none (neutral)"


def describe(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in values.items()) or "none"
