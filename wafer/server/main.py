"""`wafer serve`: load the models, serve HTTP with their engines stepped on the same event loop,
shut down gracefully."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from wafer import __version__, tracing
from wafer.config import SANDBOX_FLAGS, CacheSettings, EngineSettings, ProgramLimits, ProgramPoolSettings
from wafer.engine.async_engine import AsyncEngine, run_engines
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.speculative.config import SpeculativeConfig, draft_of, without_draft
from wafer.models.generation_defaults import NEUTRAL
from wafer.models.loader import LoadedModel, display_name, estimate_bytes
from wafer.router.config import (
    MODEL_SETTINGS,
    ConfigError,
    ServeConfig,
    catalog_config,
    default_config,
    draft_target,
    load_config,
    parse_size,
    sandbox_settings,
)
from wafer.router.router import Router
from wafer.server.app import create_app, prompt_counter
from wafer.server.generation import ServedModel
from wafer.server.tenants import keys_in

log = logging.getLogger("wafer.server")


def build_served(loaded: LoadedModel, names: list[str], settings: EngineSettings | None = None,
                 cache: CacheSettings | None = None, speculative: SpeculativeConfig | None = None,
                 draft: LoadedModel | None = None, sampling: dict[str, float] | None = None,
                 pipeline: dict[str, Any] | None = None) -> ServedModel:
    """A model ready to serve; an EngineServer steps its engine. `settings`, `cache`: the model's
    (their defaults where None). `sampling`: defaults (wafer.toml's) over the model's own.
    `pipeline`: EngineConfig's pipeline_* settings where torchrun started the stages
    (pipeline_settings()); else `settings.pipeline_parallel` stages."""
    s, c = settings or EngineSettings(), cache or CacheSettings()
    engine = LLMEngine(loaded, EngineConfig(max_running=s.max_running, max_model_len=s.max_model_len,
                                            max_batched_tokens=s.max_batched_tokens, prefix_caching=c.prefix_caching,
                                            speculative=speculative or SpeculativeConfig(),
                                            prefill_step_seconds=prefill_seconds(s.prefill_step_ms),
                                            grammar_seconds_per_token=grammar_seconds(s.grammar_ms_per_token),
                                            kv_cache_memory=c.kv_cache_memory, kv_cache_dtype=c.kv_cache_dtype,
                                            **(pipeline or {"pipeline_parallel": s.pipeline_parallel})),
                       draft=draft)
    try:
        engine.warmup()
    except BaseException:
        engine.close()  # its pipeline stages, if any
        raise
    async_engine = AsyncEngine(engine, max_waiting=s.max_waiting)
    digest = hashlib.sha256(f"{loaded.name}:{loaded.config.quantization}:{__version__}".encode()).hexdigest()
    return ServedModel(
        names=names or [loaded.name],
        engine=async_engine,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        max_model_len=engine.max_model_len,
        sampling_defaults={**NEUTRAL, **loaded.sampling, **(sampling or {})},
        fingerprint=f"fp_{digest[:10]}",
        compute={"path": loaded.compute, "kernels": loaded.kernels, "warning": loaded.warning},
    )


class ServingProcess:
    """Two settings of the Python process, made while any server of it runs and undone when the
    last one stops (a process that goes on, a test's, gets its own back):

    - What start-up made (torch, the models, the tokenizers: about 250,000 objects) lives as long as
      the server. Frozen out of the collector's sight (gc.freeze), it is no longer scanned by every
      full collection, which runs on whatever thread allocates and holds the GIL meanwhile: about
      115 ms of every stream's time on a 2-core machine. vLLM freezes its heap after start-up too.
    - The GIL changes hands after 0.5 ms instead of Python's 5. While a request is prepared in
      another thread (a schema, a long prompt: Python work that keeps the GIL), the stepping thread
      gives it up at each PyTorch call of its step and then waits out the interval to get it back:
      under bench/fuzz.py at 16 requests at a time a step's Python part took 60 to 150 ms so, and the
      longest loop stall was 152 to 243 ms against 82 to 112 ms with the shorter interval (three runs
      of each)."""

    SWITCH_INTERVAL = 0.0005

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.servers = 0
        self._interval = sys.getswitchinterval()

    def enter(self) -> None:
        with self._lock:
            gc.collect()
            gc.freeze()
            if self.servers == 0:
                self._interval = sys.getswitchinterval()
                sys.setswitchinterval(self.SWITCH_INTERVAL)
            self.servers += 1

    def exit(self) -> None:
        with self._lock:
            self.servers -= 1
            if self.servers == 0:
                gc.unfreeze()
                sys.setswitchinterval(self._interval)


SERVING = ServingProcess()  # one per process, as the collector and the GIL are


class EngineServer(uvicorn.Server):
    """uvicorn with the served models' engines stepped by a task on its own event loop. Should that
    task die, the server stops rather than accept requests nobody will answer."""

    def __init__(self, config: uvicorn.Config, served: list[ServedModel]) -> None:
        super().__init__(config)
        self.served = served
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def,override]
        self.loop = asyncio.get_running_loop()
        SERVING.enter()
        stepping = self.loop.create_task(run_engines([m.engine for m in self.served]))
        stepping.add_done_callback(self._stepping_ended)
        try:
            await super().serve(sockets)
        finally:
            stepping.cancel()
            await asyncio.gather(stepping, return_exceptions=True)  # a death was logged when it happened
            SERVING.exit()

    def _stepping_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.critical("the engine loop died; failing its requests and stopping the server", exc_info=error)
        for m in self.served:
            m.engine.fail_all(error)  # type: ignore[arg-type]
        self.should_exit = True


class GracefulServer(EngineServer):
    """On SIGTERM/SIGINT: refuse new requests, let running ones finish for `grace` seconds,
    end the rest with a final chunk, then stop. A second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, served: list[ServedModel], grace: float) -> None:
        super().__init__(config, served)
        self.grace = grace
        self._draining = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Ours instead of uvicorn's, which raises the signal again once the server is down: a
        drained server exits with status 0."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler can interrupt the loop anywhere: act on the loop's next turn.
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.handle_exit, sig, None)
        else:
            self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self._draining = True
        for m in self.served:
            m.engine.accepting = False
            m.engine.stop_background()  # batch lines are not drained: they run again after a restart
        log.info("shutting down: finishing running requests (up to %.0fs)", self.grace)
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace
        while not all(m.engine.idle for m in self.served) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not all(m.engine.idle for m in self.served):
            log.info("grace period over: ending the remaining requests")
            for m in self.served:
                m.engine.finish_all("length")
            await asyncio.sleep(0.5)  # let the final chunks reach their clients
        self.should_exit = True


def _memory_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def fit_memory(cfg: ServeConfig, budget: int | None = None) -> list[str]:
    """Drop the models that do not fit the memory budget (memory_budget_gb, or 80% of available
    memory), the largest first, and point their tiers and aliases at the models that stay.
    Returns a note for each model dropped; raises ConfigError when none fits."""
    if budget is None:
        budget = int(cfg.memory_budget_gb * 2**30) if cfg.memory_budget_gb is not None else \
            int(0.8 * _memory_available())
    need = {name: estimate_bytes(m.path, m.quant) for name, m in cfg.models.items()}
    kept, used = [], 0
    for name in sorted(cfg.models, key=lambda n: need[n]):
        if used + need[name] <= budget:
            kept.append(name)
            used += need[name]
    dropped = [n for n in cfg.models if n not in kept]
    if not dropped:
        return []
    if not kept and not cfg.upstreams:
        raise ConfigError(f"no configured model fits the memory budget of {budget / 2**30:.1f} GiB (memory_budget_gb, "
                          f"or 80% of available memory): {', '.join(f'{n} needs about {need[n] / 2**30:.1f} GiB' for n in dropped)}")
    notes = []
    stand_in = max(kept, key=lambda n: need[n]) if kept else next(iter(cfg.upstreams))
    for name in dropped:
        moved = []
        for tier, targets in cfg.tiers.items():
            if name in targets:
                cfg.tiers[tier] = [t for t in targets if t != name] or [stand_in]
                moved.append(f"{tier} -> {cfg.tiers[tier][0]}")
        for alias, target in list(cfg.aliases.items()):
            if target == name:
                cfg.aliases[alias] = stand_in
        for m in cfg.models.values():
            if draft_of(m.speculative) == name:
                m.speculative = without_draft(m.speculative)
        del cfg.models[name]
        notes.append(f"{name} was not loaded: it needs about {need[name] / 2**30:.1f} GiB and the memory budget is "
                     f"{budget / 2**30:.1f} GiB" + (f"; tier {', '.join(moved)}" if moved else ""))
    return notes


def load_models(cfg: ServeConfig, quiet: bool = False) -> list[ServedModel]:
    """Load every local model of the configuration (weights shared between entries with the same
    file); fit_memory() first drops those the memory budget cannot hold."""
    from wafer.loading import load_with_progress

    for note in fit_memory(cfg):
        log.warning(note)
        print(f"  WARNING {note}", file=sys.stderr, flush=True)
    loaded: dict[tuple[str | None, str, str], LoadedModel] = {}

    def load(path: str | None, quant: str, device: str) -> LoadedModel:
        if (path, quant, device) not in loaded:
            loaded[(path, quant, device)] = load_with_progress(path, quiet, quant, device)
        return loaded[(path, quant, device)]

    served = []
    for m in cfg.models.values():
        target = load(m.path, m.quant, m.device)
        spec = SpeculativeConfig.parse(m.speculative, int(m.num_speculative_tokens), str(m.speculative_length))
        draft = None
        if spec.draft_model is not None:
            # A model of the configuration (weights shared with its own engine) or a file of its own.
            ref = draft_target(cfg, spec.draft_model)
            other = cfg.models.get(ref)
            draft = load(other.path, other.quant, other.device) if other else load(ref, m.quant, m.device)
        cache = CacheSettings(kv_cache_dtype=m.kv_cache_dtype, kv_cache_memory=m.options.get("kv_cache_memory"),
                              prefix_caching=m.prefix_caching)
        try:
            served.append(build_served(target, [m.name], engine_settings(m.options), cache, speculative=spec,
                                       draft=draft, sampling=m.sampling, pipeline=pipeline_settings(m.options)))
            served[-1].reasoning = dict(cfg.reasoning)
        except ValueError as e:  # a draft whose tokenizer differs
            raise ConfigError(f"model {m.name!r}: {e}") from None
    return served


def engine_settings(options: dict[str, int]) -> EngineSettings:
    """A model's engine settings: its options (wafer.toml's and the CLI's), EngineSettings' defaults for the rest."""
    names = {f.name for f in fields(EngineSettings)}
    return EngineSettings(**{k: v for k, v in options.items() if k in names})


def prefill_step(options: dict[str, int]) -> float | None:
    """The seconds of prompt work a step may take by a model's options."""
    return prefill_seconds(engine_settings(options).prefill_step_ms)


def prefill_seconds(ms: int) -> float | None:
    """The seconds of prompt work a step may take for `prefill_step_ms` (0: only max_batched_tokens bounds it)."""
    if ms < 0:
        raise ConfigError(f"prefill_step_ms must be 0 or more, not {ms}")
    return ms / 1000 if ms else None


def grammar_seconds(ms: int) -> float | None:
    """The CPU seconds of grammar work a request may take per token for `grammar_ms_per_token` (0: no limit)."""
    if ms < 0:
        raise ConfigError(f"grammar_ms_per_token must be 0 or more, not {ms}")
    return ms / 1000 if ms else None


def pipeline_settings(options: dict[str, int], env: dict[str, str] | None = None) -> dict[str, Any]:
    """EngineConfig's pipeline settings for a model. Under torchrun (RANK and WORLD_SIZE set) this
    process is rank 0 of WORLD_SIZE stages that torchrun started, whose store listens on
    MASTER_PORT + 1 of MASTER_ADDR; otherwise it starts its `pipeline_parallel` - 1 stages itself."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if "RANK" in env and world > 1:
        if int(env["RANK"]) != 0:
            raise ConfigError("only rank 0 serves HTTP: start the other ranks with `python -m wafer.engine.pipeline`")
        return {"pipeline_parallel": world, "pipeline_spawn": False, "pipeline_host": env.get("MASTER_ADDR", "127.0.0.1"),
                "pipeline_port": int(env.get("MASTER_PORT", "29500")) + 1}
    return {"pipeline_parallel": engine_settings(options).pipeline_parallel}


def api_keys(given: list[str], key_file: str | None, env: dict[str, str] | None = None) -> list[str]:
    """The accepted keys: --api-key (which `ps` shows to every user of the machine), $WAFER_API_KEY
    (comma-separated) and --api-key-file (one key per line; blank lines and # comments skipped)."""
    env = os.environ if env is None else env
    # A blank key (`--api-key "$KEY"` with KEY unset) would start a server open to anyone while its
    # operator believes it keyed: refused, never dropped.
    if any(not k.strip() for k in given):
        raise ConfigError("--api-key is empty: give a key, or leave the flag out to serve without keys")
    keys = [k.strip() for k in given]
    if "WAFER_API_KEY" in env:
        from_env = [k.strip() for k in env["WAFER_API_KEY"].split(",")]
        if not all(from_env):
            raise ConfigError("$WAFER_API_KEY holds an empty key: give keys separated by commas, or unset it "
                              "to serve without keys")
        keys += from_env
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--api-key-file {key_file}: {e.strerror or e}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ConfigError(f"--api-key-file {key_file}: no key in it")
    return keys


def programs_line(limits: ProgramLimits, programs: ProgramPoolSettings) -> str:
    """Whether model-written programs run here, and within what, said at start-up: where the
    sandbox or a memory cgroup is missing, programmatic tool calling is refused, never run with
    weaker limits."""
    from wafer.agents.cgroup import find
    from wafer.agents.sandbox import check_sandbox

    reason = check_sandbox()
    if reason is not None:
        return f"WARNING programmatic tool calling is off: {reason}"
    hierarchy = find()
    assert not isinstance(hierarchy, str)  # check_sandbox() found one
    return (f"programs: sandboxed, each in a memory cgroup (v{hierarchy.version}) under {hierarchy.parent}; each "
            f"{limits.memory_bytes / 2**20:g} MiB, {limits.cpu_seconds:g} s CPU, {limits.wall_seconds:g} s; "
            f"{programs.max_running} running at once, {programs.max_parked} parked holding at most "
            f"{programs.parked_memory_bytes / 2**20:g} MiB")


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = {f.name: getattr(args, f.name) for f in fields(EngineSettings)}  # the flags bear the fields' names
    if args.kv_cache_memory is not None:
        try:
            options["kv_cache_memory"] = parse_size(args.kv_cache_memory)
        except ValueError as e:
            raise ConfigError(f"--kv-cache-memory: {e}") from None
    settings = {k: getattr(args, k) for k in MODEL_SETTINGS if k != "quant"}
    keys = api_keys(args.api_key, args.api_key_file)  # before the models load: a bad key file fails fast
    notes: list[str] = []
    if args.config:
        cfg = load_config(Path(args.config), options, args.quant, settings)
    elif args.model is None and not args.served_model_name:
        cfg, notes = catalog_config(options, args.quant, settings)
    else:
        cfg = default_config(args.model, args.served_model_name or [display_name(args.model)], options, args.quant,
                             settings)
    for note in notes:
        print(f"  WARNING {note}", file=sys.stderr, flush=True)
    # programs' limits: the flags over wafer.toml's [sandbox], checked before any model loads
    flags = {key: getattr(args, f"sandbox_{key}") for key in SANDBOX_FLAGS}
    given = {key: value for key, value in flags.items() if value is not None}
    cfg.program_limits, cfg.programs = sandbox_settings(given, lambda key: SANDBOX_FLAGS[key], cfg.program_limits,
                                                        cfg.programs)
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1 and len(cfg.models) != 1:
        raise ConfigError(f"under torchrun the ranks are one model's pipeline stages: serve one model (give its path), "
                          f"not {len(cfg.models)}")
    key_store = keys_in(args.state_db)  # tenants' keys (wafer keys), when the state database holds any
    served = load_models(cfg)
    router = Router(cfg, prompt_counter(served[0]))
    otlp = tracing.endpoint_of(args.otlp_endpoint or cfg.otlp_endpoint)  # the flag, wafer.toml's, $OTEL_*
    tracer = tracing.Tracing(otlp) if otlp is not None else None  # off: the SDK is not even imported
    app = create_app(served, keys, router=router, upstreams=cfg.upstreams, protect_metrics=args.protect_metrics,
                     state_db=args.state_db, prices=cfg.prices(), subagent_model=cfg.subagent_model,
                     key_store=key_store, max_file_bytes=args.max_file_bytes, tracer=tracer,
                     program_limits=cfg.program_limits, programs=cfg.programs)
    # uvicorn closes idle connections after 5 s by default, before the pools of most clients do
    # (aiohttp 15 s, Go 90 s, proxies more): a request sent on one as it closed was lost with
    # "Server disconnected" (once in bench/fuzz.py's 10,000 requests; vLLM has
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE for it). With the server's time the longer, the client closes first.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=args.keep_alive)
    server = GracefulServer(config, served, args.shutdown_grace)
    host = f"[{args.host}]" if ":" in args.host else args.host
    tiers = ", ".join(f"{t} -> {' | '.join(v)}" for t, v in cfg.tiers.items())
    print(f"wafer {__version__} serving on http://{host}:{args.port}/v1: models {', '.join(cfg.models)}; "
          f"tiers {tiers}; names {', '.join(router.names)}", file=sys.stderr, flush=True)
    if any(m.compute["kernels"].startswith("wafer ") for m in served):
        from wafer.kernels.build import tuning_line

        print(f"  kernels: {tuning_line()}", file=sys.stderr, flush=True)
    if key_store is not None:
        live = key_store.keys(revoked=False)
        print(f"  keys: {len(live)} of {len({k.tenant for k in live})} tenants in the state database; /metrics and "
              "the dashboard take an admin key", file=sys.stderr, flush=True)
        if not any(k.admin for k in live) and not keys:
            print("  WARNING no admin key: /metrics and the dashboard answer no one (`wafer keys add NAME --admin`)",
                  file=sys.stderr, flush=True)
    elif keys:
        print(f"  keys: {len(keys)} of --api-key / $WAFER_API_KEY / --api-key-file, each a tenant of its own",
              file=sys.stderr, flush=True)
    for m in served:
        print(f"  {m.names[0]}: compute path {m.compute['path']} on {m.compute['kernels']}", file=sys.stderr, flush=True)
        if (stages := m.engine.stats().pipeline) is not None:
            layers = " | ".join(f"{a}-{b - 1}" for a, b in stages["layers"])
            print(f"  {m.names[0]}: {stages['stages']} pipeline stages, layers {layers}", file=sys.stderr, flush=True)
        if m.compute["warning"]:
            print(f"  WARNING {m.names[0]}: {m.compute['warning']}", file=sys.stderr, flush=True)
    print(f"  {programs_line(cfg.program_limits, cfg.programs)}", file=sys.stderr, flush=True)
    if otlp is not None:
        print(f"  traces: OpenTelemetry spans to {otlp}", file=sys.stderr, flush=True)
    try:
        server.run()  # on this thread, which loaded the models and so owns their compute threads
    finally:
        for m in served:
            m.engine.close()  # pipeline stages stop with the server
    return 0
