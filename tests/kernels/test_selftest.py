"""The kernels' standalone self-test (csrc/selftest.cpp: block_linear, argmax_rows, top_candidates, exp, softmax,
rms_norm and a small decode_step against scalar references in C++, no torch) built and run for
every instruction-set variant of wafer/kernels/build.py that this machine can execute: natively each variant the
CPU runs (portable always), and the NEON variants, which an x86 machine cannot load into PyTorch,
cross-compiled and run under qemu-aarch64 (`-cpu max` has dotprod and i8mm)."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from wafer.kernels import build as kernels

pytestmark = pytest.mark.heavy

SELFTEST = kernels.SOURCE.parent / "selftest.cpp"
NATIVE = [v for v in kernels.VARIANTS if kernels.runs_here(v)]  # the x86 (or ARM) ones this CPU runs, and portable
NEON = [v for v in kernels.VARIANTS if v.arch == "aarch64"]
QEMU = ("qemu-aarch64", "-cpu", "max")
NO_CROSS_TOOLS = ("needs aarch64-linux-gnu-g++ and qemu-aarch64 on PATH "
                  "(Debian: apt-get install g++-aarch64-linux-gnu qemu-user)")


def _emulated() -> list[kernels.Variant]:
    """The NEON variants to run under qemu: those this CPU does not run itself."""
    return [v for v in NEON if not kernels.runs_here(v)]


def _neon_compiler() -> str | None:
    """The compiler for the emulated NEON variants, where they can be built and run at all."""
    if not shutil.which(QEMU[0]):
        return None
    compiler = "g++" if kernels.machine() == "aarch64" else "aarch64-linux-gnu-g++"
    return compiler if shutil.which(compiler) else None


def _build(compiler: str, flags: tuple[str, ...], out: Path) -> str | None:
    """Compiles the self-test; the compiler's output where it fails, else None."""
    cmd = [compiler, "-std=c++17", "-O2", *flags, str(SELFTEST), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return None if done.returncode == 0 else f"{' '.join(cmd)}\n{done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """Every binary the tests below run, compiled side by side: variant name -> (path, error)."""
    if not shutil.which("g++"):
        pytest.skip("needs g++")
    tmp = tmp_path_factory.mktemp("selftest")
    jobs = {v.name: ("g++", v.flags) for v in NATIVE}
    cross = _neon_compiler()
    if cross:
        jobs.update({v.name: (cross, (*v.flags, "-static")) for v in _emulated()})
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        errors = {name: pool.submit(_build, compiler, flags, tmp / name) for name, (compiler, flags) in jobs.items()}
        return {name: (tmp / name, e.result()) for name, e in errors.items()}


def _run(name: str, built: dict[str, tuple[Path, str | None]], prefix: tuple[str, ...] = ()) -> None:
    exe, error = built[name]
    assert error is None, f"the {name} self-test does not build:\n{error}"
    done = subprocess.run([*prefix, str(exe)], capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    print(out)  # shown with -s, and on failure
    assert done.returncode == 0, f"the {name} self-test failed:\n{out}"
    assert out.splitlines()[0] == f"variant {name}", out  # compiled for the variant it was meant to be
    assert "FAIL" not in out and out.rstrip().endswith(f"({name})"), out


@pytest.mark.parametrize("name", [v.name for v in NATIVE])
def test_selftest_passes_for_each_variant_this_cpu_runs(name, built):
    _run(name, built)


@pytest.mark.parametrize("name", [v.name for v in NEON])
def test_neon_selftest_passes_under_qemu(name, built):
    if kernels.runs_here(kernels.BY_NAME[name]):
        pytest.skip("this CPU runs it: the test above ran it natively")
    if not _neon_compiler():
        pytest.skip(NO_CROSS_TOOLS)
    _run(name, built, QEMU)
