"""`wafer serve` with no model: the three real tiers, and what it does when one is missing or
memory is short."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading

import pytest
from openai import OpenAI

from tests.serving import free_port, wait_healthy
from wafer.models import catalog
from wafer.router.config import ConfigError, catalog_config
from wafer.server.main import fit_memory

pytestmark = pytest.mark.heavy

ALL_INSTALLED = all(catalog.installed_path(m) for m in catalog.CATALOG)


def only_installed(monkeypatch, *tiers: str) -> None:
    real = catalog.installed_path
    monkeypatch.setattr(catalog, "installed_path", lambda m: real(m) if m.tier in tiers else None)


@pytest.mark.skipif(not ALL_INSTALLED, reason="the tiers' models are not installed (`wafer models install`)")
def test_missing_tier_is_served_by_the_nearest_model(monkeypatch):
    only_installed(monkeypatch, "terra", "luna")
    cfg, notes = catalog_config({}, "auto")
    assert cfg.tiers == {"sol": ["Qwen2.5-Coder-0.5B-Instruct"], "terra": ["Qwen2.5-Coder-0.5B-Instruct"],
                         "luna": ["SmolLM2-135M-Instruct"]}
    assert len(notes) == 1 and "sol" in notes[0] and "wafer models install" in notes[0]
    only_installed(monkeypatch)
    with pytest.raises(ConfigError, match="wafer models install"):
        catalog_config({}, "auto")


@pytest.mark.skipif(not ALL_INSTALLED, reason="the tiers' models are not installed (`wafer models install`)")
def test_short_memory_drops_the_largest_and_says_so():
    cfg, _ = catalog_config({}, "auto")
    notes = fit_memory(cfg, budget=900 << 20)  # room for the 0.5B (~620 MB of records) and SmolLM2, not the 1.5B
    assert list(cfg.models) == ["Qwen2.5-Coder-0.5B-Instruct", "SmolLM2-135M-Instruct"]
    assert cfg.tiers["sol"] == ["Qwen2.5-Coder-0.5B-Instruct"] and cfg.tiers["luna"] == ["SmolLM2-135M-Instruct"]
    assert cfg.aliases["qwen2.5-coder-1.5b-instruct"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert len(notes) == 1 and notes[0].startswith("Qwen2.5-Coder-1.5B-Instruct was not loaded") and "GiB" in notes[0]
    with pytest.raises(ConfigError, match="no configured model fits"):
        fit_memory(catalog_config({}, "auto")[0], budget=10 << 20)


@pytest.mark.skipif(not ALL_INSTALLED, reason="the tiers' models are not installed (`wafer models install`)")
def test_serve_answers_on_every_tier():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "wafer.cli", "serve", "--port", str(port), "--max-running", "2",
                             "--max-model-len", "1024"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 180)
        startup = "".join(lines)
        assert "sol -> Qwen2.5-Coder-1.5B-Instruct" in startup and "terra -> Qwen2.5-Coder-0.5B-Instruct" in startup
        assert "luna -> SmolLM2-135M-Instruct" in startup and "WARNING" not in startup
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        ids = {m.id for m in client.models.list()}
        assert {"sol", "terra", "luna", "auto", *(m.name for m in catalog.CATALOG)} <= ids
        r = client.chat.completions.create(model="sol", temperature=0, max_tokens=120, messages=[
            {"role": "user", "content": "Write a Python function add(a, b) that returns the sum. Only the code."}])
        assert r.model == "Qwen2.5-Coder-1.5B-Instruct"
        code = r.choices[0].message.content.replace("```python", "").replace("```", "")
        # Checked by its syntax tree, not run: model-written code runs only inside a sandbox.
        [fn] = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)]
        assert fn.name == "add" and [a.arg for a in fn.args.args] == ["a", "b"]
        [ret] = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
        assert isinstance(ret.value, ast.BinOp) and isinstance(ret.value.op, ast.Add)
        for tier, name in (("terra", "Qwen2.5-Coder-0.5B-Instruct"), ("luna", "SmolLM2-135M-Instruct")):
            r = client.chat.completions.create(model=tier, temperature=0, max_tokens=16,
                                               messages=[{"role": "user", "content": "Say hello."}])
            assert r.model == name and r.choices[0].message.content.strip()
    finally:
        proc.terminate()
        proc.wait(30)
