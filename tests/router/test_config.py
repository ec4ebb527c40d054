"""wafer.toml: what it accepts and what it refuses, with a message that says why."""

from __future__ import annotations

import re

import pytest

from wafer.cli import main
from wafer.router.config import ConfigError, load_config


def write(tmp_path, text: str):
    p = tmp_path / "wafer.toml"
    p.write_text(text)
    return p


def test_full_config(tmp_path):
    cfg = load_config(write(tmp_path, """
memory_budget_gb = 4
[models.small]
path = "bundled"
max_running = 4
[upstreams.cloud]
base_url = "http://127.0.0.1:9/v1/"
api_key_env = "CLOUD_KEY"
model = "big"
[tiers]
sol = ["cloud", "small"]
terra = "small"
luna = "small"
[aliases]
fast = "luna"
mine = "small"
[routing]
long_prompt_tokens = 100
tiers = { code = "sol" }
"""), {"max_running": 16, "max_model_len": 1024})
    assert cfg.models["small"].path is None and cfg.models["small"].options == {"max_running": 4, "max_model_len": 1024}
    assert cfg.upstreams["cloud"].base_url == "http://127.0.0.1:9/v1" and cfg.upstreams["cloud"].model == "big"
    assert cfg.tiers == {"sol": ["cloud", "small"], "terra": ["small"], "luna": ["small"]}
    assert cfg.routing.long_prompt_tokens == 100 and cfg.routing.tiers["code"] == "sol"
    assert cfg.memory_budget_gb == 4


@pytest.mark.parametrize("text,words", [
    ("[tiers]\nsol = 'x'", "no [models]"),
    ("[models.a]\n[tiers]\nsol = 'nope'", "'nope'"),
    ("[models.a]\n[tiers]\nmega = 'a'", "unknown tier"),
    ("[models.a]\n[aliases]\nx = 'nowhere'", "'nowhere'"),
    ("[models.a]\nspeed = 3", "unknown option"),
    ("[models.a]\nfoo = 1", "unknown option"),
    ("[models.a]\n[routing]\nbogus = 1", "bogus"),
    ("[models.a]\n[models.a.sampling]\ntemp = 0.5", "sampling: unknown sampling parameter 'temp'"),
    ("[models.a]\nsampling = { temperature = 2.5 }", "temperature must be between 0 and 2"),
    ("[models.a]\nsampling = { top_k = 4.5 }", "top_k must be an integer"),
    ("[models.a]\nsampling = 0.7", "sampling must be a table"),
    ("[models.a]\nprice = 3", "price must be a table of USD per million tokens"),
    ("[models.a]\n[agents]\nsubagents = 'luna'", "[agents] takes subagent_model"),
    ("[models.a]\nprice = { input = -1 }", "price must be a table"),
    ("[upstreams.u]\nbase_url = 'http://x/v1'\nprice = { in = 1 }", "upstream 'u': price must be a table"),
    ("[models.a]\n[routing]\ntiers = { code = 'mars' }", "mars"),
    ("[upstreams.u]\nmodel = 'x'", "base_url"),
    ("[upstreams.u]\nbase_url = 'http://x/v1'\nwafer = 'yes'", "wafer is true or false"),
    ("this is = not toml [", "invalid TOML"),
    ("[models.a]\nspeculative = 'eagle'", "expected off, ngram, suffix, draft:MODEL or auto"),
    ("[models.a]\nspeculative = 'ngram'\nnum_speculative_tokens = 0", "at least 1"),
    ("[models.a]\nspeculative = 'ngram'\nspeculative_length = 'sometimes'", "expected adaptive or fixed"),
    ("[models.a]\nspeculative = 'draft:luna'\n[upstreams.u]\nbase_url = 'http://x/v1'\n[tiers]\nluna = 'u'",
     "no local model to draft with"),
])
def test_bad_configs(tmp_path, text, words):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        load_config(p)
    assert str(p) in str(e.value)


def test_cli_refuses_bad_config_and_over_budget(tmp_path, capsys):
    assert main(["serve", "--config", str(write(tmp_path, "[models.a]\nfoo = 1"))]) == 2
    assert "unknown option" in capsys.readouterr().err
    over = write(tmp_path, "memory_budget_gb = 0.01\n[models.a]\npath = 'bundled'\n[models.b]\npath = 'bundled'\n")
    assert main(["serve", "--config", str(over)]) == 2
    err = capsys.readouterr().err
    assert "memory budget" in err and "GiB" in err


def test_draft_model_from_the_same_file_shares_its_weights(tmp_path, tiny_dir):
    from wafer.engine.speculative.draft_model import DraftModelProposer
    from wafer.server.main import load_models

    cfg = load_config(write(tmp_path, f"""
[models.small]
path = "{tiny_dir}"
max_model_len = 256
[models.big]
path = "{tiny_dir}"
quant = "int8"
max_model_len = 256
speculative = "draft:luna"
num_speculative_tokens = 3
[tiers]
sol = "big"
luna = "small"
"""), settings={"speculative": "ngram"})
    assert cfg.models["small"].speculative == "ngram"  # the CLI's value is the default
    served = {m.names[0]: m for m in load_models(cfg, quiet=True)}
    small, big = served["small"].engine.engine, served["big"].engine.engine
    assert isinstance(big.speculator.proposer, DraftModelProposer) and big.config.speculative.num_tokens == 3
    assert big.speculator.proposer.model is small.loaded.model  # luna's weights, not a second copy


def test_prices_by_the_model_name_a_completion_carries(tmp_path):
    cfg = load_config(write(tmp_path, "[models.a]\nprice = { input = 0.1, output = 0.4 }\n[models.b]\n"
                            "[upstreams.u]\nbase_url = 'http://x/v1'\nmodel = 'big'\nprice = { output = 8 }"))
    assert cfg.prices() == {"a": {"input": 0.1, "output": 0.4}, "big": {"output": 8.0}}


def test_agents_subagent_model(tmp_path):
    assert load_config(write(tmp_path, "[models.a]\n[agents]\nsubagent_model = 'luna'")).subagent_model == "luna"
    assert load_config(write(tmp_path, "[models.a]")).subagent_model is None


def test_kv_cache_memory_takes_sizes_with_units(tmp_path):
    from wafer.router.config import parse_size

    assert [parse_size(v) for v in (1024, "1024", "2GiB", "512MB", "1.5G", "64 KiB")] == [
        1024, 1024, 2 * 1024**3, 512 * 1000**2, 1_500_000_000, 64 * 1024]
    for bad in ("lots", "2 parsecs", "-1G", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    cfg = load_config(write(tmp_path, '[models.small]\npath = "bundled"\nkv_cache_memory = "256MiB"\n'))
    assert cfg.models["small"].options["kv_cache_memory"] == 256 * 1024**2
    with pytest.raises(ConfigError, match="kv_cache_memory|not a size"):
        load_config(write(tmp_path, '[models.small]\npath = "bundled"\nkv_cache_memory = "lots"\n'))


def test_sandbox_sets_programs_limits_with_sizes_and_the_rest_default(tmp_path):
    from wafer.config import ProgramLimits, ProgramPoolSettings

    cfg = load_config(write(tmp_path, '[models.a]\n[sandbox]\nmemory_bytes = "256MiB"\ncpu_seconds = 2.5\n'
                                      'max_running = 1\nmax_parked = 0\nparked_memory_bytes = 0\n'))
    assert cfg.program_limits == ProgramLimits(memory_bytes=256 * 2**20, cpu_seconds=2.5)
    assert cfg.programs == ProgramPoolSettings(max_running=1, max_parked=0, parked_memory_bytes=0)
    cfg = load_config(write(tmp_path, "[models.a]"))
    assert (cfg.program_limits, cfg.programs) == (ProgramLimits(), ProgramPoolSettings())
    with pytest.raises(ConfigError, match=re.escape("[sandbox] must be a table")):
        load_config(write(tmp_path, "sandbox = 3\n[models.a]"))


def test_prefill_step_ms_bounds_a_steps_prompt_work_or_not(tmp_path):
    from wafer.server.main import prefill_step

    cfg = load_config(write(tmp_path, '[models.small]\npath = "bundled"\nprefill_step_ms = 0\n'))
    assert prefill_step(cfg.models["small"].options) is None  # only max_batched_tokens bounds a step
    assert prefill_step({"prefill_step_ms": 120}) == 0.12
    assert prefill_step({}) == 0.05  # the default
    with pytest.raises(ConfigError, match="prefill_step_ms"):
        prefill_step({"prefill_step_ms": -1})
