"""Every setting's default is written once, in wafer.config: the CLI's flags, wafer.toml's model
entries, the server's and the engine's defaults all read it there. A flag whose default differs
from its field's fails, and so does a literal default for a known setting written anywhere else
in wafer/ (found by reading the source)."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

import wafer
from wafer import config
from wafer.cli import build_parser
from wafer.config import SETTINGS
from wafer.engine.config import EngineConfig
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.router.config import ENGINE_OPTIONS, MODEL_SETTINGS, LocalModelConfig, _parse
from wafer.server.main import build_served, engine_settings, prefill_step

ROOT = Path(wafer.__file__).parent
DEFAULTS = {f.name: f.default for cls in SETTINGS for f in fields(cls)}
# The engine's own limits on n-gram lookup, which neither the CLI nor wafer.toml sets.
NOT_FLAGS = {"ngram_max", "ngram_min", "speculate_max_running", "suffix_max_depth", "suffix_min_prob",
             "suffix_cache_tokens", "suffix_tree"}
# What a setting is called where the engine or a function takes it under another name.
OTHER_NAMES = {"num_tokens": "num_speculative_tokens", "length": "speculative_length", "compute": "quant",
               "ngram_max": "ngram_max", "ngram_min": "ngram_min"}
CHOICES = {"kv_cache_dtype": config.KV_CACHE_DTYPES, "device": config.DEVICES,
           "speculative_length": config.SPECULATIVE_LENGTHS}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_settings_have_one_default_each():
    """No field is in two settings classes, where its two defaults could part."""
    names = [f.name for cls in SETTINGS for f in fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(f.default is not MISSING for cls in SETTINGS for f in fields(cls))


def test_each_flag_defaults_to_its_field():
    commands = _subcommands()
    serve = {a.dest for a in commands["serve"]._actions}
    assert set(DEFAULTS) - NOT_FLAGS - serve == set(), "a setting `wafer serve` cannot set"
    wrong = []
    for name, parser in commands.items():
        for action in parser._actions:
            if action.dest in DEFAULTS:
                if action.default != DEFAULTS[action.dest]:
                    wrong.append(f"wafer {name} {'/'.join(action.option_strings)}: {action.default!r}, "
                                 f"field {DEFAULTS[action.dest]!r}")
                if action.dest in CHOICES and tuple(action.choices) != CHOICES[action.dest]:
                    wrong.append(f"wafer {name} {'/'.join(action.option_strings)}: choices {action.choices}")
    assert not wrong, "\n".join(wrong)


def test_the_choices_are_what_the_layers_below_accept():
    from wafer.engine.kv_layout import KV_DTYPES
    from wafer.models.quant import PATHS

    assert set(config.KV_CACHE_DTYPES) == {"auto", *KV_DTYPES}
    assert DEFAULTS["quant"] in PATHS and DEFAULTS["device"] in config.DEVICES
    assert DEFAULTS["kv_cache_dtype"] in config.KV_CACHE_DTYPES
    assert DEFAULTS["speculative_length"] in config.SPECULATIVE_LENGTHS


def test_wafer_toml_and_the_server_take_the_fields_defaults():
    assert set(MODEL_SETTINGS) | set(ENGINE_OPTIONS) <= set(DEFAULTS)
    m = _parse({"models": {"m": {"path": "bundled"}}}, {}).models["m"]
    assert {k: getattr(m, k) for k in MODEL_SETTINGS} == {k: DEFAULTS[k] for k in MODEL_SETTINGS}
    assert engine_settings(m.options) == config.EngineSettings()
    assert prefill_step(m.options) == DEFAULTS["prefill_step_ms"] / 1000
    for k in MODEL_SETTINGS:
        assert LocalModelConfig.__dataclass_fields__[k].default == DEFAULTS[k], k
    served = inspect.signature(build_served).parameters  # takes the settings whole, with no defaults of its own
    assert {"settings", "cache"} <= set(served)
    assert all(p.default in (None, inspect.Parameter.empty) for p in served.values()), served


def test_the_engine_takes_the_fields_defaults():
    engine = EngineConfig()
    for k in ("max_running", "max_batched_tokens", "kv_cache_dtype", "kv_cache_memory", "prefix_caching",
              "pipeline_parallel"):
        assert getattr(engine, k) == DEFAULTS[k], k
    spec = SpeculativeConfig()
    assert (spec.method, spec.num_tokens, spec.adaptive, spec.ngram_max, spec.ngram_min, spec.max_running) == (
        DEFAULTS["speculative"], DEFAULTS["num_speculative_tokens"], DEFAULTS["speculative_length"] == "adaptive",
        DEFAULTS["ngram_max"], DEFAULTS["ngram_min"], DEFAULTS["speculate_max_running"])
    assert SpeculativeConfig.parse("ngram") == SpeculativeConfig(method="ngram")


def _flag_dest(call: ast.Call) -> str | None:
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    dest = next((k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
    long = next((f for f in flags if f.startswith("--")), None)
    return dest or (long[2:].replace("-", "_") if long else None)


def _literal_defaults(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, setting) of each literal default for a known setting: a dataclass field, a function
    parameter, an argparse flag or a dict's .get(KEY, DEFAULT)."""
    known = set(DEFAULTS) | set(OTHER_NAMES)

    def literal(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value is not None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                        item.target.id in known and literal(item.value):
                    found.append((item.lineno, item.target.id))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            found += [(d.lineno, a.arg) for a, d in pairs if a.arg in known and literal(d)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "add_argument" and _flag_dest(node) in known:
                found += [(k.value.lineno, str(_flag_dest(node))) for k in node.keywords
                          if k.arg == "default" and literal(k.value)]
            if node.func.attr in ("get", "pop") and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value in known and literal(node.args[1]):
                found.append((node.lineno, node.args[0].value))
    return found


def _names_of_tiers(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each string that is a tier's, an alias's or a router name's, docstrings aside
    (but `auto`, which is also the value of settings such as quant)."""
    names = {*config.TIERS, *config.ROUTER_NAMES, *config.TIER_ALIASES} - {"auto"}
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names
            and id(n) not in docstrings]


def _choice_lists(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, setting) of each tuple or list literal that spells a setting's choices."""
    spelled = {tuple(v): k for k, v in CHOICES.items()}
    return [(n.lineno, spelled[values]) for n in ast.walk(tree) if isinstance(n, (ast.Tuple, ast.List))
            for values in [tuple(getattr(e, "value", None) for e in n.elts)] if values in spelled]


def _outside_config() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if "config" not in p.relative_to(ROOT).parts[:1]]


# The catalog says which of its models serves which tier: data about the models, as their files are.
TIER_DATA = {"models/catalog.py"}
# Names a known setting shares with something else, where the literal is that other thing's.
OTHER_MEANINGS = {
    # A tensor's device, or the device a model is loaded on once `auto` is resolved (wafer/loading.py
    # resolves LoadSettings.device), not the setting.
    ("engine/kv_cache.py", "device"), ("models/loader.py", "device"), ("models/quant.py", "device"),
    # The models layer's own calls: load_model and its helpers default to f32, the exact reference
    # path that library callers and tests compare against; the CLI, wafer.toml and load_with_progress
    # take LoadSettings.quant.
    ("models/loader.py", "compute"),
}


@pytest.mark.parametrize("scan", [_literal_defaults, _names_of_tiers, _choice_lists])
def test_no_default_is_written_outside_wafer_config(scan):
    found = []
    for path in _outside_config():
        where = str(path.relative_to(ROOT))
        if scan is _names_of_tiers and where in TIER_DATA:
            continue
        found += [f"wafer/{where}:{line}: {name}" for line, name in scan(ast.parse(path.read_text()))
                  if (where, name) not in OTHER_MEANINGS]
    assert not found, "\n".join(found)


def test_the_scans_find_what_they_look_for():
    """Each scan reports a default written twice, so that a clean report means something."""
    source = ast.parse('''
from dataclasses import dataclass

@dataclass
class Copy:
    num_speculative_tokens: int = 5

def parse(spec, num_tokens=5, *, length="fixed"):
    return options.get("max_running", 16), "gpt-5.6-sol"

p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=True)
p.add_argument("--kv-cache-dtype", choices=["auto", "f32", "bf16", "int8", "fp8"])
''')
    assert sorted(name for _, name in _literal_defaults(source)) == [
        "length", "max_running", "num_speculative_tokens", "num_tokens", "prefix_caching"]
    assert [name for _, name in _names_of_tiers(source)] == ["gpt-5.6-sol"]
    assert [name for _, name in _choice_lists(source)] == ["kv_cache_dtype"]


def test_the_user_guide_states_the_fields_defaults():
    """The flag tables of docs/guide/models.md give each setting's default as its field does."""
    page = (ROOT.parent / "docs" / "guide" / "models.md").read_text()
    dests = {o: a.dest for p in _subcommands().values() for a in p._actions for o in a.option_strings}
    checked, wrong = set(), []
    for row in re.findall(r"^\| `(--[a-z-]+)[^|]*\|(?: (?:both|generate|chat) \|)? ([^|]+) \|", page, re.MULTILINE):
        flag, cell = row
        name = dests.get(flag)
        value = DEFAULTS.get(name, None) if name else None
        if value is None or isinstance(value, bool):
            continue
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        checked.add(name)
        if cell.strip().strip("`") != shown:
            wrong.append(f"{flag}: the guide says {cell.strip()}, the field {shown}")
    assert {"max_running", "num_speculative_tokens", "quant", "keep_alive"} <= checked, checked
    assert not wrong, "\n".join(wrong)


def test_the_user_guide_states_the_sandbox_flags_defaults():
    """The program limits' flags (whose argparse default is None: wafer.toml's [sandbox] may set
    them) are in docs/guide/models.md with their fields' defaults."""
    page = (ROOT.parent / "docs" / "guide" / "models.md").read_text()
    defaults = {**vars(config.ProgramLimits()), **vars(config.ProgramPoolSettings())}
    wrong = []
    for key, flag in config.SANDBOX_FLAGS.items():
        value = defaults[key]
        shown = (f"{value / 2**30:g} GiB" if value % 2**30 == 0 else f"{value / 2**20:g} MiB") \
            if key.endswith("_bytes") else f"{value:g}"
        row = re.search(rf"^\| `{flag}[ `][^|]*\| ([^|]+) \|", page, re.MULTILINE)
        if row is None or row.group(1) != shown:
            wrong.append(f"{flag}: the guide says {row and row.group(1)}, the field {shown}")
    assert not wrong, "\n".join(wrong)
