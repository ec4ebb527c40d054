"""wafer as a package: the checkout's sdist and wheel, built as `python -m build` builds them, carry
the kernels' C++ sources, the server's static files and the models' licence texts; the wheel,
installed into a fresh virtual environment, builds its kernels on first use there and serves a chat
completion to the `openai` client.

The fresh environment gets wafer from the wheel alone, and its dependencies from the project's
environment (a .pth line naming that site-packages), so nothing is downloaded. The project's
environment holds the checkout installed editable, whose import hook lives in a .pth file of its own;
a plain path line does not run the .pth files of the folder it names, so that hook is never installed
and `import wafer` there can only find the wheel's copy, which a test checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import free_port, serve_process

# The server's start builds the best kernel variant from the wheel's sources first.
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "wafer" / "kernels" / "csrc"


def run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done


def checkout_files() -> list[str]:
    """The files a clone of the working tree holds: tracked or new, not ignored, not deleted."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    return [f for f in listed.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel): the sdist from a copy of the checkout, the wheel from the unpacked sdist, so
    that the wheel holds only what the sdist carries. The copy keeps setuptools' build/ and
    egg-info out of the shared checkout, and a stale build/lib's removed modules out of the wheel."""
    work = tmp_path_factory.mktemp("dists")
    src, out = work / "src", work / "dist"
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"], cwd=src)
    (sdist,) = out.glob("wafer-*.tar.gz")
    with tarfile.open(sdist) as t:
        t.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(unpacked)])
    (wheel,) = out.glob("wafer-*.whl")
    return sdist, wheel


def package_files() -> set[str]:
    """What must ship beside the Python modules: every file of the kernels' sources, the server's
    static files, and the licence text of every model `wafer models` lists."""
    from wafer.models.catalog import MODELS

    wanted = {f"wafer/kernels/csrc/{f.name}" for f in CSRC.iterdir() if f.suffix in (".cpp", ".h")}
    wanted |= {f"wafer/server/static/{f.name}" for f in (ROOT / "wafer" / "server" / "static").iterdir()}
    wanted |= {f"wafer/models/licenses/{m.license_file.name}" for m in MODELS}
    assert any(name.endswith(".h") for name in wanted) and len(wanted) > 5
    return wanted


def test_the_sdist_and_the_wheel_carry_the_sources_static_files_and_licences(dists):
    sdist, wheel = dists
    with tarfile.open(sdist) as t:
        in_sdist = {name.split("/", 1)[1] for name in t.getnames() if "/" in name}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    assert package_files() - in_sdist == set()
    assert package_files() - in_wheel == set()
    modules = {f for f in checkout_files() if f.startswith("wafer/") and f.endswith(".py")}
    assert modules - in_wheel == set()


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> Path:
    """A fresh virtual environment of the project's Python with the wheel installed in it."""
    env = tmp_path_factory.mktemp("venv") / "env"
    run([sys._base_executable, "-m", "venv", "--without-pip", str(env)])
    # pip of the project's environment installs into the new one (--python); before the .pth below
    # exists, so that it sees no wafer installed there already
    run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q", "--no-deps",
         "--no-index", str(dists[1])])
    site = Path(run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    cwd=env).stdout.strip())
    (site / "project-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a process in the new venv: no setting of the suite's that chooses the
    kernels or their folder (they build where an installed wafer puts them by default), and the
    models the project has installed (the tiers' files), so that none is fetched again."""
    from wafer.models.catalog import models_dir

    env = {k: v for k, v in os.environ.items()
           if k not in ("WAFER_KERNELS", "WAFER_KERNELS_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "WAFER_MODELS": str(models_dir()), **extra}


def test_wafer_in_the_new_environment_is_the_wheels(venv):
    code = ("import importlib.metadata, sys, wafer\n"
            "print(wafer.__file__)\n"
            "print(importlib.metadata.distribution('wafer').locate_file('wafer'))\n"
            "print(sys.prefix)")
    module, dist, prefix = run([str(venv / "bin" / "python"), "-c", code], cwd=venv, env=clean_env(venv)).stdout.split()
    assert Path(prefix) == venv
    assert Path(module).is_relative_to(venv) and Path(dist).is_relative_to(venv), (module, dist)
    assert not Path(module).is_relative_to(ROOT)


def test_the_licence_texts_wafer_models_names_are_installed(venv):
    from wafer.models.catalog import MODELS

    code = "from wafer.models.catalog import MODELS\nfor m in MODELS: print(m.license_file)"
    licences = run([str(venv / "bin" / "python"), "-c", code], cwd=venv, env=clean_env(venv)).stdout.splitlines()
    assert len(licences) == len(MODELS)
    for path in map(Path, licences):
        assert path.is_relative_to(venv) and path.is_file() and path.stat().st_size > 0, path


@pytest.fixture(scope="module")
def served(venv) -> Iterator[str]:
    """`wafer serve luna` of the new environment on a free loopback port; its base URL. Its
    kernels are not built yet: the start builds them."""
    port = free_port()
    env = clean_env(venv, WAFER_DATA_DIR=str(venv.parent / "data"))
    with serve_process([str(venv / "bin" / "wafer"), "serve", "luna", "--port", str(port)], port,
                       venv.parent / "serve.log", 600, cwd=venv.parent, env=env):
        yield f"http://127.0.0.1:{port}"


def test_the_installed_wheel_builds_its_kernels_and_serves_a_chat_completion(venv, served):
    import httpx
    from openai import OpenAI

    from wafer.kernels.build import runnable

    best = runnable()[0].name
    health = httpx.get(served + "/health", timeout=30).json()
    (model,) = health["models"]
    assert model["kernels"].startswith(f"wafer {best} ("), model  # not PyTorch's fallback after a failed build
    assert list(venv.glob(f"wafer-kernels/torch-*/{best}/*.so")), "built outside the new environment"

    client = OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="luna", messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert reply.model and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content.strip()
    assert 0 < reply.usage.completion_tokens <= 8
