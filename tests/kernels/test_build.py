"""Choosing the kernel variant: the best this CPU runs is the one that runs, every variant it runs
is built, WAFER_KERNELS forces one or turns them off, and a fallback always says so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def _status_in_a_process(env: dict[str, str], code: str = "") -> subprocess.CompletedProcess[str]:
    """status().problem of a fresh process (status() is cached), after `code` has run there."""
    script = f"from pathlib import Path\nfrom wafer.kernels import build\n{code}\nprint(build.status().problem)"
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def test_a_failed_build_names_the_compilers_first_error(tmp_path):
    """A source that does not compile (here a header missing from csrc/) is named at start-up by the
    compiler's own error, not by ninja's closing line, and the warning is logged."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.SOURCE.parent, csrc)
    (csrc / "simd.h").unlink()
    out = _status_in_a_process({"WAFER_KERNELS": "portable", "WAFER_KERNELS_DIR": str(tmp_path / "builds")},
                               f"build.SOURCE = Path({str(csrc / kernels.SOURCE.name)!r})")
    problem = out.stdout.strip()
    assert problem.startswith("wafer's portable kernels could not be built (")
    assert re.search(r"fatal error: '?simd\.h'?", problem), problem
    assert "ninja" not in problem and str(tmp_path) not in problem
    assert problem in out.stderr


def test_a_build_folder_that_cannot_be_made_is_named_with_the_setting_that_moves_it(tmp_path):
    (tmp_path / "a-file").write_text("")
    builds = tmp_path / "a-file" / "builds"
    problem = _status_in_a_process({"WAFER_KERNELS": "portable", "WAFER_KERNELS_DIR": str(builds)}).stdout.strip()
    assert str(builds) in problem and "WAFER_KERNELS_DIR chooses where the builds go" in problem


@pytest.mark.parametrize("message, cause", [
    ("Error building extension 'x': [1/2] c++ -c k.cpp\nFAILED: k.o\n/src/csrc/k.cpp:3:5: error: 'f' was not "
     "declared in this scope\n/src/csrc/k.cpp:9:1: error: expected ';'\nninja: build stopped: subcommand failed.\n",
     "k.cpp:3:5: error: 'f' was not declared in this scope"),
    ("Error building extension 'x': [2/2] c++ k.o -o x.so\nFAILED: x.so\n/usr/bin/ld: k.o: in function `g':\n"
     "k.cpp:(.text+0x1): undefined reference to `h'\ncollect2: error: ld returned 1 exit status\nninja: build stopped",
     "k.cpp:(.text+0x1): undefined reference to `h'"),
    ("Ninja is required to load C++ extensions (pip install ninja to get it)",
     "Ninja is required to load C++ extensions (pip install ninja to get it)"),
])
def test_the_cause_of_a_failed_build_is_its_first_error_line(message, cause):
    assert kernels.build_error(RuntimeError(message)) == cause


def test_the_environments_ninja_is_found_when_the_environment_is_not_activated(monkeypatch, tmp_path):
    """pip puts ninja among the environment's scripts; a process started without activating it has
    another PATH, and PyTorch's builder looks for ninja there."""
    import shutil
    import sysconfig

    scripts = sysconfig.get_path("scripts")
    if not shutil.which("ninja", path=scripts):
        pytest.skip(f"no ninja among this environment's scripts ({scripts}): pip install ninja puts one there")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    kernels.ninja_on_path()
    assert shutil.which("ninja") == str(Path(scripts) / "ninja")


def test_a_killed_builds_lock_does_not_hold_the_next_build(tmp_path):
    """PyTorch's loader waits for ever on the `lock` file a killed build left: the next build clears it,
    and only while it alone builds (a second builder waits for the first to end)."""
    import threading

    (tmp_path / "lock").touch()  # what a build killed midway leaves
    entered = threading.Event()
    release = threading.Event()

    def first() -> None:
        with kernels._building(tmp_path):
            assert not (tmp_path / "lock").exists()
            (tmp_path / "lock").touch()  # this build's own marker, as PyTorch's loader makes it
            entered.set()
            release.wait(10)
            (tmp_path / "lock").unlink()

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)
    second_in = threading.Event()

    def second() -> None:
        with kernels._building(tmp_path):
            second_in.set()

    t2 = threading.Thread(target=second)
    t2.start()
    assert not second_in.wait(0.5)  # a live build's lock is not taken from it
    assert (tmp_path / "lock").exists()
    release.set()
    t.join(10)
    assert second_in.wait(10)
    t2.join(10)
