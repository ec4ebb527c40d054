"""Which memory cgroup hierarchy programs get (read from fake /proc and /sys trees), and the refusal
where there is none: programs never run with the address-space limit alone."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from wafer.agents import cgroup, sandbox
from wafer.agents.program import Program
from wafer.agents.sandbox import SandboxUnavailable, check_sandbox


def fake_host(monkeypatch, tmp_path: Path, v2_controllers: str | None, v1: bool) -> Path:
    """A host whose server sits in /srv.service in both hierarchies."""
    mounts, own = [], {None: "/srv.service", "memory": "/srv.service"}
    if v2_controllers is not None:
        d = tmp_path / "v2" / "srv.service"
        d.mkdir(parents=True)
        (d / "cgroup.controllers").write_text(v2_controllers + "\n")
        (d / "cgroup.subtree_control").write_text("\n")
        mounts.append((str(tmp_path / "v2"), {"rw"}))
    v1_mounts = []
    if v1:
        (tmp_path / "v1" / "srv.service").mkdir(parents=True)
        v1_mounts.append((str(tmp_path / "v1"), {"rw", "memory"}))
    monkeypatch.setattr(cgroup, "_own_path", lambda controller: own[controller])
    monkeypatch.setattr(cgroup, "_mounts", lambda fstype: mounts if fstype == "cgroup2" else v1_mounts)
    cgroup.find.cache_clear()
    return tmp_path


@pytest.fixture(autouse=True)
def fresh():
    cgroup.find.cache_clear()
    check_sandbox.cache_clear()
    yield
    cgroup.find.cache_clear()
    check_sandbox.cache_clear()


def test_v2_with_the_memory_controller(monkeypatch, tmp_path):
    root = fake_host(monkeypatch, tmp_path, "cpu memory pids", v1=True)
    assert cgroup.find() == cgroup.Hierarchy(2, root / "v2" / "srv.service")
    assert (root / "v2" / "srv.service" / "cgroup.subtree_control").read_text() == "+memory"


def test_v1_where_v2_has_no_memory_controller(monkeypatch, tmp_path):
    # this project's CI: a hybrid host whose memory controller is on the v1 hierarchy
    root = fake_host(monkeypatch, tmp_path, "hugetlb", v1=True)
    assert cgroup.find() == cgroup.Hierarchy(1, root / "v1" / "srv.service")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test installs it)")
def test_no_memory_cgroup_refuses_programs(monkeypatch, tmp_path):
    fake_host(monkeypatch, tmp_path, "cpu pids", v1=False)
    reason = cgroup.check()
    assert reason is not None and "no memory controller" in reason
    assert check_sandbox() == f"programs need a memory cgroup of their own: {reason}"
    with pytest.raises(SandboxUnavailable, match="memory cgroup"):
        asyncio.run(Program.start("text(1)", []))
    with pytest.raises(SandboxUnavailable, match="memory cgroup"):
        asyncio.run(sandbox.spawn(["-c", "pass"], sandbox.Limits()))


def test_a_cgroup_left_by_a_dead_server_is_swept(tmp_path):
    dead = tmp_path / f"{cgroup.PREFIX}999999999-0"
    mine = tmp_path / f"{cgroup.PREFIX}{os.getpid()}-0"
    dead.mkdir()
    mine.mkdir()
    cgroup.sweep(tmp_path)
    assert not dead.exists() and mine.exists()
