"""The `wafer` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wafer.cli import build_parser


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wafer.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_info_default_model():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "8192" in r.stdout and "Q4_1" in r.stdout
    assert "23,040 bf16 (auto), 46,080 f32, 12,240 int8" in r.stdout  # 2 x 30 layers x 3 KV heads x 64 x 2 bytes


def test_info_gemma3_splits_kv_bytes_by_layer_type():
    from wafer.models import catalog

    if catalog.installed_path(catalog.find("gemma-3-270m")) is None:
        pytest.skip("gemma-3-270m is not installed (`wafer models install`, which `make test` runs)")
    r = run("info", "gemma-3-270m")
    assert r.returncode == 0, r.stderr
    assert "gemma3" in r.stdout and "4 query, 1 KV (head dim 256)" in r.stdout
    # 2 (K and V) x 1 KV head x 256 x 2 bytes (bfloat16, auto on its q8 path) = 1,024 a layer; 3 global of 18;
    # int8 and fp8 rows are 256 codes and a 4-byte scale
    assert ("18,432 bf16 (auto), 36,864 f32, 9,360 int8, 9,360 fp8; at bf16: global 3 layers x 1,024 = 3,072; "
            "windowed (512 tokens) 15 layers x 1,024 = 15,360") in r.stdout


def test_info_names_the_compute_path():
    r = run("info", "--quant", "int8")
    assert r.returncode == 0, r.stderr
    assert "int8" in r.stdout and "compute path" in r.stdout


def test_generate_streams_greedy_text():
    r = run("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stderr


def test_chat_is_multi_turn():
    args = ("chat", "--temperature", "0", "--max-tokens", "40")
    r = run(*args, stdin="I have a dog called Biscuit.\nWhat is my dog called?\n/exit\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.split(">>> ")
    assert len(replies) == 4  # two answers, then the prompt that read /exit
    # The second answer recalls the name given only in the first turn (at temperature 0 the default
    # q4 path and f32 both do; asked alone, the question gets no such name).
    assert "Biscuit" in replies[2], replies
    alone = run(*args, stdin="What is my dog called?\n").stdout.split(">>> ")[1]
    assert "Biscuit" not in alone, alone


def test_a_negative_prefill_step_is_refused_before_any_model_loads(capsys):
    with pytest.raises(SystemExit) as e:  # by argparse: no model is loaded to find it out
        build_parser().parse_args(["serve", "--prefill-step-ms", "-5"])
    assert e.value.code == 2
    assert "--prefill-step-ms: must be 0 or more, not -5" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--prefill-step-ms", "0"]).prefill_step_ms == 0


def test_generate_and_chat_sample_with_the_model_s_defaults_where_no_flag_is_given():
    from types import SimpleNamespace

    from wafer.cli import sampling_from_args

    model = SimpleNamespace(sampling={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1})
    for command in (["generate", "hi"], ["chat"]):
        p = sampling_from_args(build_parser().parse_args(command), model)
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.8, 20, 0.0, 1.1)
        p = sampling_from_args(build_parser().parse_args([*command, "--temperature", "0", "--top-k", "5"]), model)
        assert (p.temperature, p.top_p, p.top_k) == (0, 0.8, 5)
    # a model without defaults samples as OpenAI's API does
    p = sampling_from_args(build_parser().parse_args(["chat"]), SimpleNamespace(sampling={}))
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def test_chat_talks_to_the_largest_installed_tier(capsys):
    from wafer.cli import chat_model
    from wafer.config import TIERS
    from wafer.models import catalog

    assert chat_model("luna") == "luna"
    installed = [t for t in TIERS if catalog.installed_path(catalog.find(t)) is not None]
    assert chat_model(None) == installed[0]  # luna, the bundled model, at least
    assert (installed[0] != TIERS[0]) == ("is not installed" in capsys.readouterr().err)


def test_help_shows_the_defaults():
    for command in ("generate", "chat", "serve"):
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        assert "(default: 4096)" in text and "(default: auto)" in text, text


def test_models_fits_80_columns_but_for_the_paths():
    r = run("models")
    assert r.returncode == 0, r.stderr
    paths = ("  file ", "  license ")  # a file's path, as long as where it is installed
    long = [line for line in r.stdout.splitlines() if len(line) > 80 and not line.startswith(paths)]
    assert not long, long
