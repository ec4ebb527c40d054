"""A GGUF model for the q4 and q8 compute paths, made from the file's own blocks.

Every linear layer's records (blockquant.pack_blocks) are made from the file's blocks a few
thousand rows at a time (gguf_blocks.py) straight into their place in one HugePageArena, and the
embedding stays in the file's blocks, so no tensor is ever whole in float32 and the peak memory of
a load is the final footprint plus a few megabytes. The file is mapped, and each tensor's pages
are dropped from the process once converted.

Converting takes seconds for a model of a billion parameters, so the records are kept on disk
(catalog.models_dir() / "records"), and a later load maps that file (_map_cache). A cache entry is
named by the file (path, size, modification time), the compute path and the record format, so an
edited file or a new format never reads a stale one; WAFER_RECORD_CACHE=off turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from wafer.models import blockquant as bq
from wafer.models.config import ModelConfig
from wafer.models.gguf_blocks import (
    GGUFEmbedding,
    format_for,
    pack_records,
    record_bytes,
    record_inputs_per,
    record_parts,
    record_size,
)
from wafer.models.gguf_loader import GGUFFile
from wafer.models.families import new_model
from wafer.models.gemma3 import Gemma3Model
from wafer.models.llama import LlamaModel
from wafer.models.quant import BlockLinear

log = logging.getLogger(__name__)

RECORD_FORMAT = 2  # bump when pack_blocks's layout or gguf_blocks's conversions change
CACHE_MIN_BYTES = 64 << 20  # smaller ones (the tests' tiny models) convert in a blink: not worth the disk
ROWS = 4096  # rows converted at once (a multiple of 16, the records' group)


@dataclass
class LinearPlan:
    module: str  # its path in the model, e.g. "layers.3.self_attn.qkv_proj"
    parts: list[str]  # the file's tensors (Hugging Face names) stacked into it, in order
    rows: list[int]  # each part's output rows
    in_features: int
    fmt: int  # gguf_blocks: 4 or 8 bits, or the K4, K6 records

    @property
    def nbytes(self) -> int:
        return -(-record_bytes(sum(self.rows), self.in_features, self.fmt) // 64) * 64


def plan(cfg: ModelConfig, file: GGUFFile, path: str) -> list[LinearPlan]:
    """Every linear layer of the model, with the record width it gets on compute path `path`."""

    def info(name: str) -> tuple[int, int, object]:
        found = file.raw(name)
        if found is None:
            raise KeyError(name)
        raw, qtype, k = found
        return raw.shape[0], k, qtype

    def linear(module: str, parts: list[str], head: bool = False) -> LinearPlan:
        infos = [info(n) for n in parts]
        fmt = format_for([q for _, _, q in infos], path, head)  # type: ignore[misc]
        return LinearPlan(module, parts, [r for r, _, _ in infos], infos[0][1], fmt)

    out = []
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        out += [linear(m + "self_attn.qkv_proj", [p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                linear(m + "self_attn.o_proj", [p + "self_attn.o_proj.weight"]),
                linear(m + "mlp.gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                linear(m + "mlp.down_proj", [p + "mlp.down_proj.weight"])]
    tied = cfg.tie_word_embeddings or file.raw("lm_head.weight") is None
    out.append(linear("lm_head", ["model.embed_tokens.weight" if tied else "lm_head.weight"], head=True))
    return out


def _convert(file: GGUFFile, lp: LinearPlan, dest: torch.Tensor) -> None:
    """Fill `dest` (uint8, lp.nbytes) with the records of lp, ROWS rows at a time."""
    per_group = (lp.in_features // record_inputs_per(lp.fmt)) * record_size(lp.fmt)
    if any(r % 16 for r in lp.rows[:-1]):  # a part that ends mid-group: stack whole, then pack
        pieces = [record_parts(*file.raw(n), lp.fmt) for n in lp.parts]  # type: ignore[misc]
        packed = pack_records(tuple(torch.cat(t) for t in zip(*pieces)), lp.fmt)
        dest[: packed.numel()].copy_(packed.view(-1))
        return
    at = 0
    for name in lp.parts:
        raw, qtype, k = file.raw(name)  # type: ignore[misc]
        for start in range(0, raw.shape[0], ROWS):
            packed = pack_records(record_parts(raw[start : start + ROWS], qtype, k, lp.fmt), lp.fmt).view(-1)
            dest[at : at + packed.numel()].copy_(packed)
            at += packed.numel()
        assert at % per_group == 0
        file.release(name)


def _cache_paths(file: GGUFFile, path: str, plans: list[LinearPlan]) -> tuple[Path, Path] | None:
    setting = os.environ.get("WAFER_RECORD_CACHE", "on")
    if setting == "off" or sum(lp.nbytes for lp in plans) < CACHE_MIN_BYTES:
        return None
    from wafer.models.catalog import models_dir

    st = file.path.stat()
    ident = json.dumps([str(file.path.resolve()), st.st_size, st.st_mtime_ns, path, RECORD_FORMAT,
                        [asdict(lp) for lp in plans]])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    base = Path(setting) if setting not in ("on", "") else models_dir() / "records"
    stem = f"{file.path.stem}.{path}"
    return base / f"{stem}.{key}.bin", base / f"{stem}.{key}.json"


def _map_cache(image: Path, manifest: Path, nbytes: int) -> torch.Tensor | None:
    """The cached records mapped read-only from their file, or None where they do not match.

    Mapped rather than copied: the file is in the page cache after its first use, where the kernel
    keeps it in large folios that a read-only mapping gets as 2 MB pages (ext4 and XFS on recent
    kernels), so decoding reads them as fast as a huge-page arena. A fresh arena instead costs a page
    fault per 2 MB that must zero the page, or, on a VM whose host took back the free memory, fetch
    it from the host: 0.6 s for terra's 421 MB here, against 20 ms to map. A writable private
    mapping would lose the 2 MB pages, so the records are read-only: nothing writes to them after a
    load. Like llama.cpp's default mmap, the pages are clean and may be dropped under memory
    pressure, and then read again from the file."""
    try:
        size = _padded(nbytes)
        if json.loads(manifest.read_text()).get("nbytes") != nbytes or image.stat().st_size != size:
            return None
        with open(image, "rb") as f:
            area = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ)
    except (OSError, ValueError, AttributeError):  # AttributeError: no MAP_PRIVATE (not POSIX)
        return None
    with warnings.catch_warnings():  # "not writable": by design, see above
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(area, dtype=torch.uint8)[:nbytes]  # the tensor keeps the mapping alive


def _padded(nbytes: int) -> int:
    """The cache file's size: the records, then zeros to a whole 2 MB page, so that the last of them
    are mapped as one too."""
    return -(-nbytes // bq.HUGE_PAGE) * bq.HUGE_PAGE


def _write_cache(image: Path, manifest: Path, area: torch.Tensor) -> None:
    try:
        image.parent.mkdir(parents=True, exist_ok=True)
        for old in image.parent.glob(image.name.rsplit(".", 2)[0] + ".*"):
            old.unlink(missing_ok=True)  # this file's and path's records in an older format or version
        tmp = image.with_suffix(".partial")
        data, whole = memoryview(area.numpy()), area.numel() // bq.HUGE_PAGE * bq.HUGE_PAGE
        with open(tmp, "wb") as f:  # the last 2 MB padded and written at once: the page cache keeps it whole
            f.write(data[:whole])
            f.write(bytes(data[whole:]).ljust(_padded(area.numel()) - whole, b"\0"))
        tmp.replace(image)
        manifest.write_text(json.dumps({"nbytes": area.numel(), "format": RECORD_FORMAT}))
    except OSError as e:  # a full or read-only disk: the next load converts again
        log.warning("could not keep the converted records in %s: %s", image.parent, e)


def build_block_model(cfg: ModelConfig, file: GGUFFile, path: str,
                      progress: Callable[[int], None] | None = None) -> tuple[LlamaModel | Gemma3Model, int]:
    """The model of a GGUF file on compute path `path` (q4 or q8), and its parameter count."""
    with torch.device("meta"):
        model = new_model(cfg)
    plans = plan(cfg, file, path)
    cfg.tie_word_embeddings = plans[-1].parts[0] == "model.embed_tokens.weight"
    total = sum(lp.nbytes for lp in plans)
    cache = _cache_paths(file, path, plans)
    area = _map_cache(*cache, total) if cache is not None and cache[0].exists() else None
    cached = area is not None
    if area is None:
        area = bq.HugePageArena(total).take(total)
    n_params, at = 0, 0
    for i, lp in enumerate(plans):
        dest = area[at : at + lp.nbytes]
        at += lp.nbytes
        if not cached:
            _convert(file, lp, dest)
        bias = None
        if lp.module.endswith("qkv_proj") and cfg.attention_bias:
            bias = torch.cat([_small(file, n.replace(".weight", ".bias")) for n in lp.parts])
            n_params += bias.numel()
        owner, _, attr = lp.module.rpartition(".")
        n = sum(lp.rows)
        records = dest[: record_bytes(n, lp.in_features, lp.fmt)].view(
            -(-n // 16), lp.in_features // record_inputs_per(lp.fmt), record_size(lp.fmt))
        setattr(model.get_submodule(owner) if owner else model, attr,
                BlockLinear.from_packed(records, n, lp.in_features, lp.fmt, bias))
        if lp.module != "lm_head" or not cfg.tie_word_embeddings:
            n_params += n * lp.in_features
        if progress and lp.module.endswith("down_proj"):
            progress(i // 4 + 1)
    if cache is not None and not cached:
        _write_cache(*cache, area)
    emb, qtype, dim = file.raw("model.embed_tokens.weight")  # type: ignore[misc]
    model.embed_tokens = GGUFEmbedding(emb, qtype, dim)
    n_params += emb.shape[0] * dim
    # The norms stay float32: each family's own set (Gemma 3 has four per block and QK norms).
    state = {name: _small(file, "model." + name) for name, _ in model.named_parameters() if name.endswith("norm.weight")}
    model.load_state_dict(state, strict=False, assign=True)
    n_params += sum(t.numel() for t in state.values())
    model.eval()
    _trim_heap()
    return model, n_params


def _small(file: GGUFFile, name: str) -> torch.Tensor:
    t = file.tensor(name)
    if t is None:
        raise KeyError(name)
    return t


def _trim_heap() -> None:
    """Give the conversion's freed temporaries back to the system: glibc keeps freed blocks below
    its (adaptive) mmap threshold in the heap, where they would count as the server's memory."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
