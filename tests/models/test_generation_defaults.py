"""Sampling defaults from the model: generation_config.json, GGUF metadata, the card table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny import hf_to_gguf, with_generation_config
from wafer.models.generation_defaults import check, from_hf_dir
from wafer.models.loader import load_model

# What a Hugging Face model's authors write; do_sample false as many files have it beside a temperature.
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "temperature": 0.6, "top_p": 0.95,
                     "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 99}


@pytest.fixture(scope="module")
def tiny_with_defaults(tiny_dir: Path, tmp_path_factory) -> Path:
    return with_generation_config(tiny_dir, tmp_path_factory.mktemp("with-defaults") / "tiny", GENERATION_CONFIG)


def test_hf_directory_defaults_come_from_generation_config(tiny_with_defaults):
    loaded = load_model(str(tiny_with_defaults))
    # do_sample false does not make it greedy (as in vLLM); max_new_tokens is not a sampling default here.
    assert loaded.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                               "repetition_penalty": 1.1}
    assert loaded.sampling_source == "generation_config.json"


def test_a_directory_without_them_has_none(tiny_dir):
    assert load_model(str(tiny_dir)).sampling == {}


def test_values_a_request_could_not_send_are_dropped(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 5.0, "top_k": "40", "top_p": None, "min_p": 0.1, "repetition_penalty": True}))
    assert from_hf_dir(tmp_path) == {"min_p": 0.1}
    assert "temperature must be between 0 and 2" in caplog.text


def test_gguf_defaults_come_from_its_metadata(tiny_dir, tmp_path):
    path = hf_to_gguf(tiny_dir, tmp_path / "tiny.gguf", kv={
        "general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.top_p": 0.8,
        "general.sampling.min_p": 0.02, "general.sampling.penalty_repeat": 1.2, "general.sampling.mirostat": 2})
    loaded = load_model(str(path))
    assert loaded.sampling == pytest.approx(  # float32 in the file
        {"temperature": 0.7, "top_k": 40, "top_p": 0.8, "min_p": 0.02, "repetition_penalty": 1.2})
    assert type(loaded.sampling["top_k"]) is int and loaded.sampling_source == "GGUF metadata"


def test_the_bundled_model_gets_its_cards_recommendation(smollm):
    # Its GGUF has no sampling metadata and its general.name is not its name: the table, by file name.
    assert smollm.sampling == {"temperature": 0.2, "top_p": 0.9}
    assert smollm.sampling_source == "wafer's table of model cards"


def test_a_files_own_values_win_over_the_card_key_by_key(tiny_dir, tmp_path):
    path = hf_to_gguf(tiny_dir, tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf", kv={"general.sampling.temp": 0.5})
    loaded = load_model(str(path))
    assert loaded.sampling == pytest.approx({"temperature": 0.5, "top_p": 0.9})
    assert loaded.sampling_source == "GGUF metadata over wafer's table of model cards"


@pytest.mark.parametrize("values,words", [
    ({"temp": 0.5}, "unknown sampling parameter 'temp'"),
    ({"temperature": True}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 1.5}, "top_p must be between 0 and 1"),
    ({"repetition_penalty": 0}, "repetition_penalty must be between"),
])
def test_check_refuses_what_a_request_could_not_send(values, words):
    with pytest.raises(ValueError, match=words):
        check(values)
