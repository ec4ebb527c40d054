"""`wafer serve --config wafer.toml`: models, tiers, aliases, upstreams and routing rules.

    [models.small]
    path = "bundled"            # or a GGUF file / Hugging Face directory
    quant = "q4"                # compute path: auto (default), f32, bf16, int8, q8 or q4 (see quant.py)
    device = "cpu"              # auto (default: cuda when there is one), cpu or cuda
    max_running = 16            # engine options: max_running, max_waiting, max_model_len, max_batched_tokens,
    pipeline_parallel = 1       # kv_cache_memory, prefill_step_ms, pipeline_parallel (stage processes of the model)
    speculative = "ngram"       # off (default), ngram, suffix, draft:NAME (a model of this file, a tier, or a path),
                                # auto (ngram and suffix), or several joined by commas: "auto,draft:terra"
    num_speculative_tokens = 5  # K, the most tokens proposed a step
    speculative_length = "adaptive"  # adaptive (default: up to K, as measured steps pay) or fixed (K)
    prefix_caching = true

    price = {input = 0.05, output = 0.2}  # USD per million tokens: the agents' cost accounting

    [models.small.sampling]     # defaults for requests that leave them out, over the model's own
    temperature = 0.7           # (generation_config.json, GGUF metadata or its card: generation_defaults.py);
    top_p = 0.9                 # any of temperature, top_p, top_k, min_p, repetition_penalty

    [upstreams.cloud]
    base_url = "http://10.0.0.5:8000/v1"
    api_key_env = "CLOUD_API_KEY" # the key is read from this environment variable
    model = "big-model"         # the name sent upstream
    price = {input = 1.25, output = 10.0}

    [upstreams.pool]            # copies of one model (router/replicas.py), instead of base_url:
    replicas = ["http://10.0.0.6:8000/v1", "http://10.0.0.7:8000/v1"]
    policy = "prefix"           # or least_outstanding (default): fewest requests in flight
    model = "SmolLM2-135M-Instruct"
    cooldown = 10               # seconds a failing replica is left out (doubling while it fails)

    [tiers]
    sol = ["cloud", "small"]    # first target serves; the rest are fallbacks, in order
    terra = "small"
    luna = "small"

    [aliases]
    fast = "luna"               # a name clients may use, for a tier or a model

    [routing]                   # the rule set behind `auto` and `gpt-5.6` (see rules.py)
    long_prompt_tokens = 1500
    short_prompt_tokens = 200
    hints = ["think hard", "think carefully"]

    [reasoning]                 # reasoning budget in tokens per `reasoning_effort` (wafer/server/reasoning.py);
    low = 256                   # levels left out keep their defaults (REASONING_BUDGETS); none is always 0
    high = 2048

    otlp_endpoint = "http://localhost:4318"  # the requests' traces (wafer/tracing.py)

    [sandbox]                   # model-written programs' limits (wafer/config/sandbox.py), each field of
    memory_bytes = "256MiB"     # ProgramLimits and ProgramPoolSettings; `wafer serve`'s flags override them
    max_running = 2

    [agents]                    # /v1/responses (wafer/agents/)
    subagent_model = "luna"     # Ultra's sub-agents run on this model or tier (default: the root's)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from wafer.config import (
    DEVICES,
    KV_CACHE_DTYPES,
    MAY_BE_ZERO,
    MIN_MEMORY_BYTES,
    NO_TOOL_CALLS,
    NO_TOOL_RESULTS,
    REASONING_BUDGETS,
    ROUTER_NAMES,
    ROUTING_TIERS,
    TIER_ALIASES,
    TIERS,
    CacheSettings,
    EngineSettings,
    LoadSettings,
    ProgramLimits,
    ProgramPoolSettings,
    ServerSettings,
    SpeculationSettings,
)
from wafer.engine.speculative.config import SpeculativeConfig, draft_of, without_draft
from wafer.errors import WaferError
from wafer.models.generation_defaults import check as check_sampling
from wafer.models.quant import PATHS

__all__ = ["DEVICES", "KV_CACHE_DTYPES", "REASONING_BUDGETS", "ROUTER_NAMES", "TIERS", "TIER_ALIASES"]  # wafer.config's

# A model's integer options (LocalModelConfig.options): the engine's settings and the KV cache's budget.
ENGINE_OPTIONS = (*(f.name for f in fields(EngineSettings)), "kv_cache_memory")


class ConfigError(WaferError):
    pass


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(value: int | str) -> int:
    """Bytes from 1073741824, "1GiB", "512MB" or "1.5G" (decimal units, and binary ones with an i)."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size (e.g. 2GiB, 512MB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class LocalModelConfig:
    name: str
    path: str | None  # None: the bundled default
    options: dict[str, int] = field(default_factory=dict)  # ENGINE_OPTIONS given; the rest take EngineSettings'
    quant: str = LoadSettings.quant  # the compute path
    device: str = LoadSettings.device
    speculative: str = SpeculationSettings.speculative  # off | ngram | suffix | draft:NAME | auto, or a comma list
    num_speculative_tokens: int = SpeculationSettings.num_speculative_tokens
    speculative_length: str = SpeculationSettings.speculative_length
    prefix_caching: bool = CacheSettings.prefix_caching
    kv_cache_dtype: str = CacheSettings.kv_cache_dtype
    sampling: dict[str, float] = field(default_factory=dict)  # over the model's own defaults
    price: dict[str, float] = field(default_factory=dict)  # USD per million tokens, input and output


# Per-model settings besides the integer engine options; the CLI's values are their defaults.
MODEL_SETTINGS = ("quant", "device", "speculative", "num_speculative_tokens", "speculative_length", "prefix_caching",
                  "kv_cache_dtype")


@dataclass
class UpstreamConfig:
    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    timeout: float = 120.0
    price: dict[str, float] = field(default_factory=dict)
    # Several servers of the same model instead of base_url (replicas.py): how to share requests
    # between them, and how long one that failed is left out.
    replicas: list[str] = field(default_factory=list)
    policy: str = "least_outstanding"  # or "prefix"
    cooldown: float = 10.0
    health_interval: float = 5.0
    balance_slack: int = 4
    wafer: bool = False  # the upstream is a wafer server: wafer's own request fields pass on to it

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass
class RoutingConfig:
    long_prompt_tokens: int = 1500
    short_prompt_tokens: int = 200
    hints: list[str] = field(default_factory=lambda: [
        "think hard", "think harder", "think carefully", "think deeply", "ultrathink", "take your time",
        "reason carefully"])
    multi_step_min_steps: int = 3
    tiers: dict[str, str] = field(default_factory=lambda: dict(ROUTING_TIERS))  # rule -> tier
    # tiers whose model does not call tools: tool_choice auto requests with tools go to tiers["tool_calls"]
    no_tool_calls: list[str] = field(default_factory=lambda: list(NO_TOOL_CALLS))
    # tiers whose model calls a tool again instead of answering from its result: requests ending with a
    # tool result go to tiers["tool_results"]
    no_tool_results: list[str] = field(default_factory=lambda: list(NO_TOOL_RESULTS))


@dataclass
class ServeConfig:
    models: dict[str, LocalModelConfig]
    upstreams: dict[str, UpstreamConfig]
    tiers: dict[str, list[str]]  # tier -> targets (model or upstream names), primary first
    aliases: dict[str, str]  # client name -> tier or model name
    routing: RoutingConfig
    memory_budget_gb: float | None = None
    reasoning: dict[str, int] = field(default_factory=lambda: dict(REASONING_BUDGETS))  # effort -> tokens
    subagent_model: str | None = None  # [agents]: where Ultra's sub-agents run (None: the root's model)
    otlp_endpoint: str | None = ServerSettings.otlp_endpoint  # where the traces go (--otlp-endpoint overrides)
    # [sandbox]: model-written programs' limits, one program's and the server's over all of them
    program_limits: ProgramLimits = field(default_factory=ProgramLimits)
    programs: ProgramPoolSettings = field(default_factory=ProgramPoolSettings)

    def prices(self) -> dict[str, dict[str, float]]:
        """Prices by the model name a completion carries: a local model's name, an upstream's model."""
        out = {u.model: u.price for u in self.upstreams.values() if u.price}
        out.update({m.name: m.price for m in self.models.values() if m.price})
        return out

    def check(self) -> None:
        targets = set(self.models) | set(self.upstreams)
        for tier in TIERS:
            if tier not in self.tiers:
                raise ConfigError(f"tier {tier!r} is not configured")
            for t in self.tiers[tier]:
                if t not in targets:
                    raise ConfigError(f"tier {tier!r} names {t!r}, which is neither a model nor an upstream")
        for alias, target in self.aliases.items():
            if target not in TIERS and target not in targets:
                raise ConfigError(f"alias {alias!r} points at {target!r}, which is not a tier, model or upstream")
        for m in self.models.values():
            try:
                spec = SpeculativeConfig.parse(m.speculative, int(m.num_speculative_tokens), str(m.speculative_length))
            except ValueError as e:
                raise ConfigError(f"model {m.name!r}: {e}") from None
            if spec.draft_model in TIERS and not any(t in self.models for t in self.tiers[spec.draft_model]):
                raise ConfigError(f"model {m.name!r}: tier {spec.draft_model!r} has no local model to draft with")
        for rule, tier in self.routing.tiers.items():
            if tier not in TIERS:
                raise ConfigError(f"routing rule {rule!r} sends to {tier!r}, which is not a tier")
        for key in ("no_tool_calls", "no_tool_results"):
            for tier in getattr(self.routing, key):
                if tier not in TIERS:
                    raise ConfigError(f"[routing] {key} names {tier!r}, which is not a tier")


def default_config(model: str | None, names: list[str], options: dict[str, int], quant: str = LoadSettings.quant,
                   settings: dict[str, Any] | None = None) -> ServeConfig:
    """No file: one model serves every tier and answers to its own names (the first is canonical).
    `settings`: values for MODEL_SETTINGS other than quant."""
    name = names[0]
    cfg = ServeConfig(
        models={name: LocalModelConfig(name, model, options, quant, **(settings or {}))},
        upstreams={},
        tiers={t: [name] for t in TIERS},
        aliases={n: name for n in names[1:]},
        routing=RoutingConfig(),
    )
    cfg.check()
    return cfg


def catalog_config(options: dict[str, int], quant: str = LoadSettings.quant, settings: dict[str, Any] | None = None,
                   ) -> tuple[ServeConfig, list[str]]:
    """No file and no model: the catalog's models on their tiers (sol, terra, luna), each also under
    its own name. A tier whose model is not installed is served by the nearest installed one; the
    notes say which (they are empty when all three are there)."""
    from wafer.models import catalog

    installed = [m for m in catalog.CATALOG if catalog.installed_path(m) is not None]
    if not installed:
        raise ConfigError("no model of `wafer models` is installed; run `wafer models install`")
    settings = dict(settings or {})
    spelled = str(settings.get("speculative", SpeculationSettings.speculative))
    draft = catalog.find(draft_of(spelled) or "")
    models = {}
    for m in installed:
        own = dict(settings)
        if draft_of(spelled) is not None and draft is not None and \
                catalog.CATALOG.index(m) >= catalog.CATALOG.index(draft):
            own["speculative"] = without_draft(spelled)  # a draft drafts for the larger tiers, not for itself or smaller ones
        models[m.name] = LocalModelConfig(m.name, str(catalog.installed_path(m)), dict(options), quant, **own)
    tiers: dict[str, list[str]] = {}
    notes = []
    order = [m.tier for m in catalog.CATALOG]
    for m in catalog.CATALOG:
        if m in installed:
            tiers[m.tier] = [m.name]
            continue
        i = order.index(m.tier)  # the nearest installed model, preferring a smaller one
        stand_in = min(installed, key=lambda x: (abs(order.index(x.tier) - i), -order.index(x.tier)))
        tiers[m.tier] = [stand_in.name]
        notes.append(f"tier {m.tier} ({m.name}) is not installed (`wafer models install {m.name}`); "
                     f"{stand_in.name} serves it")
    aliases = {m.name.lower(): m.name for m in installed}
    cfg = ServeConfig(models, {}, tiers, aliases, RoutingConfig())
    cfg.check()
    return cfg, notes


def load_config(path: Path, cli_options: dict[str, int] | None = None, quant: str = LoadSettings.quant,
                settings: dict[str, Any] | None = None) -> ServeConfig:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    try:
        return _parse(raw, cli_options or {}, quant, settings or {})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: invalid configuration ({e})") from None


def _price(value: Any, where: str) -> dict[str, float]:
    if value is None:
        return {}
    ok = isinstance(value, dict) and set(value) <= {"input", "output"} and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value.values())
    if not ok:
        raise ConfigError(f"{where}: price must be a table of USD per million tokens, e.g. "
                          "price = {input = 0.15, output = 0.6}")
    return {k: float(v) for k, v in value.items()}


def _reasoning(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ConfigError("[reasoning] must be a table of tokens per effort level, e.g. low = 256")
    unknown = set(value) - set(REASONING_BUDGETS)
    if unknown:
        raise ConfigError(f"[reasoning] has no effort level(s) {sorted(unknown)}; levels are "
                          f"{', '.join(REASONING_BUDGETS)}")
    for level, tokens in value.items():
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ConfigError(f"[reasoning] {level} must be a whole number of tokens, 0 or more")
    if value.get("none", 0) != 0:
        raise ConfigError("[reasoning] none is always 0 tokens")
    return {**REASONING_BUDGETS, **value}


def _parse(raw: dict[str, Any], cli_options: dict[str, int], quant: str = LoadSettings.quant,
           settings: dict[str, Any] | None = None) -> ServeConfig:
    models = {}
    for name, m in (raw.get("models") or {}).items():
        path = m.get("path", "bundled")
        try:
            opts = {**cli_options, **{k: parse_size(v) if k == "kv_cache_memory" else int(v)
                                      for k, v in m.items() if k in ENGINE_OPTIONS}}
        except ValueError as e:
            raise ConfigError(f"model {name!r}: {e}") from None
        unknown = set(m) - {"path", "sampling", "price", *MODEL_SETTINGS, *ENGINE_OPTIONS}
        if unknown:
            raise ConfigError(f"model {name!r}: unknown option(s) {sorted(unknown)}")
        if m.get("quant", quant) not in PATHS:
            raise ConfigError(f"model {name!r}: quant must be one of {', '.join(PATHS)}")
        if m.get("device", LoadSettings.device) not in DEVICES:
            raise ConfigError(f"model {name!r}: device must be one of {', '.join(DEVICES)}")
        if m.get("kv_cache_dtype", CacheSettings.kv_cache_dtype) not in KV_CACHE_DTYPES:
            raise ConfigError(f"model {name!r}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        own = {**(settings or {}), **{k: m[k] for k in MODEL_SETTINGS if k in m and k != "quant"}}
        if not isinstance(m.get("sampling", {}), dict):
            raise ConfigError(f"model {name!r}: sampling must be a table, e.g. sampling = {{temperature = 0.7}}")
        try:
            sampling = check_sampling(m.get("sampling", {}))
        except ValueError as e:
            raise ConfigError(f"model {name!r}: sampling: {e}") from None
        models[name] = LocalModelConfig(name, None if path == "bundled" else str(path), opts, m.get("quant", quant),
                                        **own, sampling=sampling, price=_price(m.get("price"), f"model {name!r}"))
    upstreams = {}
    for name, u in (raw.get("upstreams") or {}).items():
        upstreams[name] = _upstream(name, u)
    if not models and not upstreams:
        raise ConfigError("no [models] and no [upstreams]")
    first = next(iter(models or upstreams))
    tiers = {}
    for tier in TIERS:
        value = (raw.get("tiers") or {}).get(tier, first)
        tiers[tier] = [value] if isinstance(value, str) else list(value)
    unknown_tiers = set(raw.get("tiers") or {}) - set(TIERS)
    if unknown_tiers:
        raise ConfigError(f"unknown tier(s) {sorted(unknown_tiers)}; tiers are {', '.join(TIERS)}")
    routing = RoutingConfig()
    for key, value in (raw.get("routing") or {}).items():
        if key == "tiers":
            routing.tiers = {**routing.tiers, **value}
        elif hasattr(routing, key):
            setattr(routing, key, value)
        else:
            raise ConfigError(f"[routing] has no option {key!r}")
    agents = raw.get("agents") or {}
    if not isinstance(agents, dict) or set(agents) - {"subagent_model"} or \
            not isinstance(agents.get("subagent_model", ""), str):
        raise ConfigError("[agents] takes subagent_model = \"NAME\" (a model or tier) and nothing else")
    otlp = raw.get("otlp_endpoint", ServerSettings.otlp_endpoint)
    if otlp is not None and not isinstance(otlp, str):
        raise ConfigError("otlp_endpoint is a URL, e.g. otlp_endpoint = \"http://localhost:4318\"")
    if not isinstance(raw.get("sandbox", {}), dict):
        raise ConfigError("[sandbox] must be a table of programs' limits, e.g. memory_bytes = \"256MiB\"")
    limits, programs = sandbox_settings(raw.get("sandbox", {}))
    cfg = ServeConfig(models, upstreams, tiers, dict(raw.get("aliases") or {}), routing, raw.get("memory_budget_gb"),
                      _reasoning(raw.get("reasoning", {})), agents.get("subagent_model"), otlp, limits, programs)
    cfg.check()
    return cfg


# [sandbox]'s keys, each a field of ProgramLimits or ProgramPoolSettings, with its type (that of its default).
SANDBOX_KEYS = {f.name: type(f.default) for cls in (ProgramLimits, ProgramPoolSettings) for f in fields(cls)}


def sandbox_settings(values: dict[str, Any], where: Callable[[str], str] = lambda key: f"[sandbox] {key}",
                     limits: ProgramLimits | None = None, programs: ProgramPoolSettings | None = None,
                     ) -> tuple[ProgramLimits, ProgramPoolSettings]:
    """`values` by field name (wafer.toml's [sandbox], or the flags' over it) over `limits` and
    `programs` (the defaults where None), each checked; a bad one is a ConfigError that names it as
    `where` spells it. Sizes take 512MiB, 2GiB or bytes (parse_size); counts whole numbers; seconds
    any number."""
    unknown = set(values) - set(SANDBOX_KEYS)
    if unknown:
        raise ConfigError(f"[sandbox] has no option(s) {sorted(unknown)}; options are {', '.join(SANDBOX_KEYS)}")
    checked = {key: _sandbox_value(value, key, where(key)) for key, value in values.items()}
    limits, programs = limits or ProgramLimits(), programs or ProgramPoolSettings()
    own = {f.name for f in fields(ProgramLimits)}
    return (replace(limits, **{k: v for k, v in checked.items() if k in own}),
            replace(programs, **{k: v for k, v in checked.items() if k not in own}))


def _sandbox_value(value: Any, key: str, where: str) -> int | float:
    size, kind = key.endswith("_bytes"), SANDBOX_KEYS[key]
    what = ("a size, e.g. 256MiB or 1GiB, or bytes" if size else "a whole number" if kind is int else
            "a number of seconds")
    least = (f"at least {MIN_MEMORY_BYTES // 2**20}MiB (a program's Python needs that much to start and import the "
             "standard library)" if key == "memory_bytes" else "0 or more" if key in MAY_BE_ZERO else "more than 0")
    number: int | float = math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = parse_size(str(value)) if size else int(str(value)) if kind is int else float(value)
        except ValueError:
            pass
    low = MIN_MEMORY_BYTES if key == "memory_bytes" else 0
    if not (math.isfinite(number) and number >= low and (number > 0 or key in MAY_BE_ZERO)):
        raise ConfigError(f"{where} must be {what}, {least}, not {value!r}")
    return number


REPLICA_POLICIES = ("least_outstanding", "prefix")
UPSTREAM_OPTIONS = {"base_url", "model", "api_key_env", "timeout", "price", "replicas", "policy", "cooldown",
                    "health_interval", "balance_slack", "wafer"}


def _upstream(name: str, u: dict[str, Any]) -> UpstreamConfig:
    where = f"upstream {name!r}"
    unknown = set(u) - UPSTREAM_OPTIONS
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {sorted(unknown)}")
    replicas = u.get("replicas", [])
    if not isinstance(replicas, list) or not all(isinstance(r, str) and r for r in replicas):
        raise ConfigError(f"{where}: replicas must be a list of base URLs, e.g. [\"http://10.0.0.5:8000/v1\"]")
    if ("base_url" in u) == bool(replicas):
        raise ConfigError(f"{where} needs base_url, or replicas (a list of base URLs), not both")
    if u.get("policy", UpstreamConfig.policy) not in REPLICA_POLICIES:
        raise ConfigError(f"{where}: policy must be one of {', '.join(REPLICA_POLICIES)}")
    try:
        numbers = {k: float(u[k]) for k in ("timeout", "cooldown", "health_interval") if k in u}
        slack = int(u.get("balance_slack", UpstreamConfig.balance_slack))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: timeout, cooldown and health_interval are seconds, balance_slack a count") from None
    if any(v <= 0 for v in numbers.values()) or slack < 0:
        raise ConfigError(f"{where}: timeout, cooldown and health_interval must be positive, balance_slack >= 0")
    if not isinstance(u.get("wafer", False), bool):
        raise ConfigError(f"{where}: wafer is true or false (whether the upstream is a wafer server)")
    base = u.get("base_url") or replicas[0]
    return UpstreamConfig(name, base.rstrip("/"), u.get("model", name), u.get("api_key_env"),
                          numbers.get("timeout", UpstreamConfig.timeout), _price(u.get("price"), where),
                          [r.rstrip("/") for r in replicas], u.get("policy", UpstreamConfig.policy),
                          numbers.get("cooldown", UpstreamConfig.cooldown),
                          numbers.get("health_interval", UpstreamConfig.health_interval), slack,
                          u.get("wafer", UpstreamConfig.wafer))


def draft_target(cfg: ServeConfig, name: str) -> str:
    """What `draft:NAME` points at: a model of the file, the first local model of a tier, or a path."""
    if name in cfg.models:
        return name
    if name in TIERS:
        return next(t for t in cfg.tiers[name] if t in cfg.models)
    return name
