"""check_sandbox's verdict, and the refusal where the sandbox cannot start: nothing runs outside it."""
from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from wafer.agents import sandbox
from wafer.agents.program import Program
from wafer.agents.sandbox import Limits, SandboxUnavailable, check_sandbox


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test installs it)")
def test_check_sandbox_is_usable_where_bwrap_is_installed():
    assert check_sandbox() is None


@pytest.fixture()
def no_bwrap(monkeypatch):
    which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, *a, **k: None if name == "bwrap" else which(name, *a, **k))
    check_sandbox.cache_clear()
    yield
    check_sandbox.cache_clear()


def test_without_bwrap_programs_are_refused(no_bwrap, tmp_path):
    assert check_sandbox() == "bubblewrap (bwrap) is not installed"
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        asyncio.run(Program.start(f"open({str(marker)!r}, 'w').write('ran')", []))
    with pytest.raises(SandboxUnavailable):
        asyncio.run(sandbox.spawn(["-c", f"open({str(marker)!r}, 'w').write('ran')"], Limits()))
    assert not marker.exists()


def test_a_sandbox_that_cannot_start_is_refused(monkeypatch):
    # bwrap present but failing (as where unprivileged user namespaces are off): the trial run says so.
    # Not under tmp_path: as root the sandbox starts as an unprivileged uid, which pytest's 0700
    # directories keep out.
    home = Path(tempfile.mkdtemp())
    home.chmod(0o755)
    fake = home / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, *a, **k: str(fake) if name == "bwrap" else which(name, *a, **k))
    check_sandbox.cache_clear()
    try:
        assert check_sandbox() == "the sandbox could not start: bwrap: No permissions to create new namespace"
        with pytest.raises(SandboxUnavailable, match="No permissions"):
            asyncio.run(Program.start("text(1)", []))
    finally:
        check_sandbox.cache_clear()
        shutil.rmtree(home)
