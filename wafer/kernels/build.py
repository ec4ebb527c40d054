"""wafer's CPU kernels (csrc/): one source, compiled once per instruction-set variant, the best
variant that this CPU runs chosen at run time.

| variant | CPUs | integer dot product |
|---|---|---|
| avx512-vnni | Intel Ice Lake and later servers, AMD Zen 4 and later | VPDPBUSD, 512 bits |
| avx2-vnni | Intel Alder Lake and later desktops and laptops (AVX-VNNI) | VPDPBUSD, 256 bits |
| avx2 | every x86-64 CPU of the last ten years (Haswell, Zen 1-3) | VPMADDUBSW + VPMADDWD |
| neon-i8mm | ARMv8.6 (Graviton 3 and 4, Apple M2 and later) | USDOT |
| neon-dotprod | ARMv8.2 with dot products (Graviton 2, Ampere Altra, Apple M1) | SDOT |
| portable | anything with a C++17 compiler | loops the compiler vectorises for its target |

The variants are built when the project is set up (`python -m wafer.kernels`, which `make`
runs: it builds each variant this CPU can run and fails with the compiler's message), and cached
under WAFER_KERNELS_DIR (default: a folder of the Python environment). `WAFER_KERNELS` chooses:
unset or `auto` the best variant this CPU runs, a variant's name to force it (the tests run each
one that way), `off` for PyTorch's own kernels (the `int8` path). A fallback is never silent: the
reason is logged at start-up and shown by `wafer info` and `/health` (status()).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from wafer.kernels import tuning
from wafer.kernels.machine import cpu

log = logging.getLogger("wafer.kernels")
SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str  # "x86_64", "aarch64", or "any"
    needs: tuple[str, ...]  # CPU features (Linux's /proc/cpuinfo names)
    flags: tuple[str, ...]  # the compiler's target flags


_X86 = ("-mavx2", "-mfma", "-mf16c")
VARIANTS = (  # best first
    Variant("avx512-vnni", "x86_64", ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
            ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512vnni", *_X86)),
    Variant("avx2-vnni", "x86_64", ("avx_vnni", "avx2", "fma", "f16c"), ("-mavxvnni", *_X86)),
    Variant("avx2", "x86_64", ("avx2", "fma", "f16c"), _X86),
    Variant("neon-i8mm", "aarch64", ("asimddp", "i8mm"), ("-march=armv8.2-a+dotprod+i8mm",)),
    Variant("neon-dotprod", "aarch64", ("asimddp",), ("-march=armv8.2-a+dotprod",)),
    Variant("portable", "any", (), ()),
)
BY_NAME = {v.name: v for v in VARIANTS}


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 `flags`, ARM `Features`); on macOS the
    few that matter here, from sysctl."""
    if flags := cpu().flags:
        return frozenset(flags)
    if sys.platform == "darwin":
        found = set()
        for feature, name in (("FEAT_DotProd", "asimddp"), ("FEAT_I8MM", "i8mm")):
            out = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{feature}"], capture_output=True, text=True)
            if out.stdout.strip() == "1":
                found.add(name)
        return frozenset(found)
    return frozenset()


def runs_here(v: Variant) -> bool:
    return (v.arch in ("any", machine())) and all(f in cpu_features() for f in v.needs)


def runnable() -> list[Variant]:
    """Every variant this CPU executes, best first (the last is always `portable`)."""
    return [v for v in VARIANTS if runs_here(v)]


def wanted() -> str | None:
    """The variant WAFER_KERNELS asks for (None: off). Raises ValueError for a name this CPU
    cannot run or that does not exist."""
    choice = os.environ.get("WAFER_KERNELS", "auto").strip().lower() or "auto"
    if choice == "off":
        return None
    if choice == "auto":
        return runnable()[0].name
    if choice not in BY_NAME:
        raise ValueError(f"WAFER_KERNELS={choice!r}: choose auto, off or one of {', '.join(BY_NAME)}")
    if not runs_here(BY_NAME[choice]):
        raise ValueError(f"WAFER_KERNELS={choice}: this CPU ({machine()}) lacks "
                         f"{', '.join(f for f in BY_NAME[choice].needs if f not in cpu_features()) or 'the architecture'}")
    return choice


def build_dir() -> Path:
    root = os.environ.get("WAFER_KERNELS_DIR")
    base = Path(root) if root else Path(sys.prefix) / "wafer-kernels"
    return base / f"torch-{torch.__version__}"


def _module_name(variant: str) -> str:
    return "wafer_kernels_" + variant.replace("-", "_")


def fingerprint(v: Variant) -> str:
    """What a variant's build is made from: every file of csrc/ (the headers too) and its flags."""
    h = hashlib.sha256(" ".join(v.flags).encode())
    for f in sorted(SOURCE.parent.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@cache
def load(variant: str) -> ModuleType:
    """The compiled extension of one variant (built now if set-up did not), with this machine's
    tuning for it applied where there is one (tuning.py). Raises on a failed build."""
    module = _import_or_build(variant)
    found = tuned(variant)
    if found is not None:  # a fresh module's table is empty: every shape at its default
        tuning.apply(module, found)
    return module


@cache
def tuned(variant: str) -> tuning.Tuning | None:
    """The tuner's result for this variant on this CPU and these sources (None: not tuned here)."""
    return tuning.load(tuning.path_in(build_dir(), variant), tuning.key_for(variant, fingerprint(BY_NAME[variant])))


def ninja_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH, and pip installs it among the environment's scripts,
    which PATH lacks wherever the environment is not activated: put them there when no ninja is found."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@contextmanager
def _building(out: Path) -> Iterator[None]:
    """One build of a variant at a time, whatever PyTorch's loader leaves behind.

    PyTorch's loader marks a build with a `lock` file that it removes when it ends; a build killed
    midway leaves it, and every later build waits on it for ever. An flock on `building` dies with
    its holder, so whoever holds it is the only builder, and a `lock` it finds is a dead build's."""
    import fcntl  # POSIX only, as the build is

    with open(out / "building", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (out / "lock").unlink(missing_ok=True)
        yield


def _import_or_build(variant: str) -> ModuleType:
    """The compiled extension of one variant, built now if set-up did not. Raises on a failed build.

    A build whose stamp matches the sources is imported as it is: PyTorch's loader would import
    setuptools and run ninja to find that out, a tenth of a second of every start."""
    v = BY_NAME[variant]
    out = build_dir() / variant
    library, stamp = out / (_module_name(variant) + ".so"), out / "sources.sha256"
    sources = fingerprint(v)
    if library.exists() and stamp.exists() and stamp.read_text() == sources:
        spec = importlib.util.spec_from_file_location(_module_name(variant), library)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    from torch.utils.cpp_extension import load as load_extension

    ninja_on_path()
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob(_module_name(variant) + "*.so")):
        log.warning("building wafer's %s kernels now (set-up normally does: python -m wafer.kernels)", variant)
    with _building(out):
        module = load_extension(name=_module_name(variant), sources=[str(SOURCE)], build_directory=str(out),
                                verbose=False, extra_cflags=["-O3", "-fopenmp", *v.flags], extra_ldflags=["-fopenmp"])
    if Path(module.__file__ or "") == library:  # not a renamed rebuild (PyTorch's _v1 after a change in-process)
        stamp.write_text(sources)
    return module


@dataclass
class Status:
    variant: str | None  # the variant that runs, None: PyTorch's kernels
    problem: str | None  # why it is not the best this CPU runs, when it is not


@cache
def status() -> Status:
    """Which variant runs and, where it is not the best, why (logged once, as a warning)."""
    s = _status()
    if s.problem:
        log.warning("%s", s.problem)
    return s


def _status() -> Status:
    best = runnable()[0].name
    try:
        name = wanted()
    except ValueError as e:
        return Status(None, str(e))
    if name is None:
        return Status(None, "WAFER_KERNELS=off: PyTorch's kernels run instead of wafer's")
    try:
        load(name)
    except Exception as e:  # noqa: BLE001 - any build failure: the stock path, said out loud
        return Status(None, f"wafer's {name} kernels could not be built ({build_error(e)})")
    return Status(name, None if name == best else f"WAFER_KERNELS={name} (the best on this CPU is {best})")


_COMPILER_ERROR = re.compile(r"error:|undefined reference")


def build_error(e: BaseException) -> str:
    """The line of a failed build that names its cause. PyTorch's exception holds ninja's whole
    output, whose last line ("ninja: build stopped") names none: the compiler's or linker's first
    error line does, its file named without the folder. A folder that cannot be written (an
    environment installed read-only, say) is named with the setting that moves the builds. Any other
    failure gives its last line."""
    if isinstance(e, OSError) and e.filename:
        path, builds = Path(e.filename), build_dir()
        if path == builds or path in builds.parents or builds in path.parents:
            return f"{e}; WAFER_KERNELS_DIR chooses where the builds go"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    first = next((line for line in lines if _COMPILER_ERROR.search(line)), None)
    if first is not None:
        return re.sub(r"^\S*/", "", first)
    return lines[-1] if lines else type(e).__name__


def tuning_line() -> str:
    """The active variant's tuning for this machine in a line (`wafer info`, the server's start-up)."""
    variant = status().variant
    if variant is None:
        return "none (wafer's kernels do not run)"
    found = tuned(variant)
    if found is None:
        return f"{variant}: not tuned for this CPU (python -m wafer.kernels --tune, or wafer models install)"
    return f"{variant}: {found.summary()}"


def kernels() -> ModuleType | None:
    """The active variant's extension, or None (WAFER_KERNELS=off, or it could not be built:
    status().problem says which, and it was logged)."""
    s = status()
    return load(s.variant) if s.variant else None


def features_line() -> str:
    """The CPU features that choose among the variants, as found."""
    relevant = sorted({f for v in VARIANTS for f in v.needs} & cpu_features())
    return f"{machine()}: {' '.join(relevant) or 'none of the SIMD features wafer uses'}"


def _build_one(v: Variant) -> tuple[str, str | None]:
    code = f"from wafer.kernels.build import load; load({v.name!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return v.name, None if out.returncode == 0 else (out.stdout + out.stderr)


def main() -> int:
    """Build every variant this CPU runs (in parallel processes); exit 1 with the compiler's output
    when one fails. WAFER_KERNELS=off skips the build."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("WAFER_KERNELS", "").strip().lower() == "off":
        print("WAFER_KERNELS=off: wafer's CPU kernels not built; PyTorch's kernels will run")
        return 0
    variants = runnable()
    print(f"building wafer's CPU kernels ({features_line()}): {', '.join(v.name for v in variants)}", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(_build_one, variants))
    failed = [(name, err) for name, err in results if err]
    for name, err in failed:
        print(f"--- wafer's {name} kernels failed to build:\n{err}", file=sys.stderr)
    if failed:
        print("Set WAFER_KERNELS=off to set up without them (PyTorch's slower kernels run instead).", file=sys.stderr)
        return 1
    print(f"built into {build_dir()}; the default is {variants[0].name}")
    return 0

