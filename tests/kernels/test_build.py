"""Choosing the kernel variant: the best this CPU runs is the one that runs, every variant it runs
is built, WAFER_KERNELS forces one or turns them off, and a fallback always says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wafer.kernels import build as kernels


def test_the_variants_this_cpu_runs_follow_its_flags():
    names = [v.name for v in kernels.runnable()]
    have = kernels.cpu_features()
    assert names[-1] == "portable"
    if kernels.machine() == "x86_64":
        assert ("avx2" in names) == ({"avx2", "fma", "f16c"} <= have)
        assert ("avx2-vnni" in names) == ({"avx2", "fma", "f16c", "avx_vnni"} <= have)
        assert ("avx512-vnni" in names) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= have)
    if kernels.machine() == "aarch64":
        assert ("neon-dotprod" in names) == ("asimddp" in have)
    assert names == [v.name for v in kernels.VARIANTS if v.name in names]  # best first


def test_every_variant_this_cpu_runs_is_built_and_is_what_it_says():
    for v in kernels.runnable():
        assert kernels.load(v.name).variant == v.name


@pytest.mark.skipif(os.environ.get("WAFER_KERNELS", "auto") != "auto", reason="WAFER_KERNELS chooses another")
def test_the_best_variant_is_the_active_one():
    """Fails where the CPU supports a variant that does not run (a failed build included)."""
    s = kernels.status()
    assert s.variant == kernels.runnable()[0].name and s.problem is None
    assert kernels.kernels().variant == s.variant


def _report(env: dict[str, str]) -> str:
    code = ("from wafer.models.quant import kernel_report, resolve\n"
            "p = resolve('auto', 'cpu', 'Q4_1'); print(p, *kernel_report(p), sep='|')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_forced_variant_runs_and_is_reported():
    forced = kernels.runnable()[-1].name  # portable: every CPU runs it
    path, what, warning = _report({"WAFER_KERNELS": forced}).split("|")
    assert path == "q4" and what.startswith(f"wafer {forced} (")
    best = kernels.runnable()[0].name
    assert (warning == "None") == (forced == best)
    assert warning == "None" or f"the best on this CPU is {best}" in warning


def test_kernels_off_falls_back_with_a_warning():
    path, what, warning = _report({"WAFER_KERNELS": "off"}).split("|")
    assert path == "int8" and what.startswith("PyTorch") and "WAFER_KERNELS=off" in warning


def test_a_variant_this_cpu_cannot_run_is_refused_clearly():
    foreign = next(v for v in kernels.VARIANTS if not kernels.runs_here(v))
    path, _, warning = _report({"WAFER_KERNELS": foreign.name}).split("|")
    assert path == "int8" and f"WAFER_KERNELS={foreign.name}: this CPU" in warning
    path, _, warning = _report({"WAFER_KERNELS": "sse9"}).split("|")
    assert path == "int8" and "choose auto, off or one of" in warning


def test_a_built_variant_loads_without_the_build_tools_until_its_sources_change():
    """A build whose stamp matches csrc/ is imported as it is (no setuptools, no ninja at start-up);
    a changed source goes back to PyTorch's loader, which rebuilds."""
    name = kernels.runnable()[-1].name
    kernels.load(name)  # built and stamped
    code = (
        "import sys, types\n"
        "import torch.utils.cpp_extension as ce\n"
        "from wafer.kernels import build as kernels\n"
        "calls = []\n"
        "ce.load = lambda **kw: calls.append(kw) or types.SimpleNamespace(__file__='elsewhere')\n"
        f"assert kernels.load({name!r}).variant == {name!r} and not calls\n"
        "kernels.load.cache_clear()\n"
        "kernels.fingerprint = lambda v: 'a changed source'\n"
        f"assert kernels.load({name!r}).__file__ == 'elsewhere' and len(calls) == 1\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stamp = kernels.build_dir() / name / "sources.sha256"
    assert stamp.read_text() == kernels.fingerprint(kernels.BY_NAME[name])  # left as it was
