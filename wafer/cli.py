"""The `wafer` command: generate, chat, info, serve, models, keys, bench."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

from wafer.config import (
    DEVICES,
    KV_CACHE_DTYPES,
    NO_TOOL_CALLS,
    NO_TOOL_RESULTS,
    ROUTING_TIERS,
    SANDBOX_FLAGS,
    SPECULATIVE_LENGTHS,
    TIERS,
    CacheSettings,
    EngineSettings,
    LoadSettings,
    ProgramLimits,
    ProgramPoolSettings,
    ServerSettings,
    SpeculationSettings,
)
from wafer.errors import WaferError
from wafer.loading import load_with_progress

if TYPE_CHECKING:
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import LoadedModel

EXIT_USAGE = 2


def make_engine(loaded: "LoadedModel", args: argparse.Namespace) -> "LLMEngine":
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine

    return LLMEngine(loaded, EngineConfig(max_model_len=args.max_model_len))


# The sampling flags of `generate` and `chat`; one left out takes the model's default, as a request
# to the server that leaves it out does.
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_from_args(args: argparse.Namespace, loaded: "LoadedModel") -> "SamplingParams":
    from wafer.engine.sequence import SamplingParams
    from wafer.models.generation_defaults import NEUTRAL

    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    chosen: dict[str, Any] = {**NEUTRAL, **loaded.sampling, **given}
    return SamplingParams(max_tokens=args.max_tokens, temperature=chosen["temperature"], top_p=chosen["top_p"],
                          top_k=int(chosen["top_k"]), min_p=chosen["min_p"],
                          repetition_penalty=chosen["repetition_penalty"], seed=args.seed,
                          ignore_eos=getattr(args, "ignore_eos", False))


def chat_model(asked: str | None) -> str | None:
    """The model `wafer chat` talks to: the one asked for, else the largest installed tier (the
    bundled luna is always there)."""
    if asked is not None:
        return asked
    from wafer.models import catalog

    for tier in TIERS:
        m = catalog.find(tier)
        if m is not None and catalog.installed_path(m) is not None:
            if tier != TIERS[0]:
                print(f"wafer chat: {TIERS[0]} is not installed (`wafer models install`); talking to {tier}",
                      file=sys.stderr)
            return tier
    return None


def stream(engine: "LLMEngine", prompt_ids: list[int], params: "SamplingParams") -> tuple[str, int, float, float]:
    """Print tokens as they come; returns (text, tokens, time to first token, decode seconds)."""
    start = time.perf_counter()
    seq = engine.add(prompt_ids, params)
    first: float | None = None
    while not seq.finished:
        for out in engine.step():
            if out.seq_id != seq.seq_id:
                continue
            if first is None:
                first = time.perf_counter()
            sys.stdout.write(out.text)
            sys.stdout.flush()
    end = time.perf_counter()
    first = first or end
    return seq.text, len(seq.output_ids), first - start, end - first


def cmd_generate(args: argparse.Namespace) -> int:
    loaded = load_with_progress(args.model, args.quiet, args.quant, args.device)
    engine = make_engine(loaded, args)
    tok = loaded.tokenizer
    if args.chat:
        ids = tok.encode(loaded.chat_template.render([{"role": "user", "content": args.prompt}]), add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    engine.warmup()
    _, n, ttft, decode_s = stream(engine, ids, sampling_from_args(args, loaded))
    sys.stdout.write("\n")
    if not args.quiet:
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
        print(f"[{len(ids)} prompt tokens, {n} generated; TTFT {ttft * 1000:.0f} ms; decode {rate:.1f} tokens/s]",
              file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    loaded = load_with_progress(chat_model(args.model), args.quiet, args.quant, args.device)
    engine = make_engine(loaded, args)
    tok = loaded.tokenizer
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print(f"wafer chat: {loaded.name}; /reset starts over, /exit quits", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(loaded.chat_template.render(history), add_special_tokens=False)
        if len(ids) + args.max_tokens >= engine.max_model_len:
            print("(conversation too long for the context; /reset to start over)", file=sys.stderr)
            history.pop()
            continue
        try:
            text, *_ = stream(engine, ids, sampling_from_args(args, loaded))
        except KeyboardInterrupt:
            text = ""
        print()
        history.append({"role": "assistant", "content": text})


def cmd_info(args: argparse.Namespace) -> int:
    from wafer.models.loader import resolve_path

    path = resolve_path(args.model)
    from wafer.kernels import build as kernels_build
    from wafer.models.generation_defaults import describe as describe_sampling
    from wafer.models.quant import describe

    loaded = load_with_progress(args.model, quiet=True, compute=args.quant, device=args.device)
    c = loaded.config
    rows = [
        ("model", loaded.name),
        ("path", str(path)),
        ("architecture", c.arch),
        ("parameters", f"{loaded.num_parameters:,}"),
        ("file weights", c.quantization),
        ("device", str(loaded.model.norm.weight.device)),
        ("compute path", f"{loaded.compute}: {describe(loaded.compute)}"),
        ("kernels", loaded.kernels + (f"  WARNING: {loaded.warning}" if loaded.warning else "")),
        ("kernel tuning", kernels_build.tuning_line()),
        ("layers", str(c.num_layers)),
        ("hidden size", str(c.hidden_size)),
        ("attention heads", f"{c.num_heads} query, {c.num_kv_heads} KV (head dim {c.head_dim})"),
        ("context length", str(c.max_position_embeddings)),
        ("KV bytes per token", _kv_bytes_line(loaded)),
        ("vocabulary", str(c.vocab_size)),
        ("rope", f"theta {c.rope_theta:g}" + (f", scaling {c.rope_scaling}" if c.rope_scaling else "")
         + (f"; windowed layers theta {c.extra['rope_local_theta']:g}" if "rope_local_theta" in c.extra else "")),
        ("sliding window", "none" if not c.sliding_window else str(c.sliding_window) if c.layer_windows is None
         else f"{c.sliding_window} on {sum(w is not None for w in c.windows)} of {c.num_layers} layers"),
        ("tied embeddings", str(c.tie_word_embeddings).lower()),
        ("chat template", "model's own" if loaded.tokenizer.chat_template else "default (ChatML)"),
        ("sampling defaults", f"{describe_sampling(loaded.sampling)} (from {loaded.sampling_source})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _kv_bytes_line(loaded: "LoadedModel") -> str:
    """KV bytes per token in each KV dtype (the one `auto` picks first), split by layer type where
    some layers attend to a window."""
    from wafer.engine.kv_layout import KV_DTYPES, bytes_per_token, kv_dtype

    c = loaded.config
    chosen = kv_dtype("auto", loaded)
    names = sorted(KV_DTYPES, key=lambda n: KV_DTYPES[n] != chosen)
    line = ", ".join(f"{bytes_per_token(c, KV_DTYPES[n]):,} {n}" + (" (auto)" if KV_DTYPES[n] == chosen else "")
                     for n in names)
    windows = c.windows
    if all(w is None for w in windows):
        return line
    per_layer = bytes_per_token(c, chosen) // c.num_layers
    kinds = []
    for w in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
        n = windows.count(w)
        kind = "global" if w is None else f"windowed ({w:,} tokens)"
        kinds.append(f"{kind} {n} layers x {per_layer:,} = {n * per_layer:,}")
    return f"{line}; at {names[0]}: {'; '.join(kinds)}"


def cmd_models(args: argparse.Namespace) -> int:
    """List the catalog's models (installed or not), install them, or check their files again."""
    from wafer.errors import ModelLoadError
    from wafer.models import catalog

    chosen = list(catalog.MODELS)
    if args.names:
        chosen = []
        for name in args.names:
            m = catalog.find(name)
            if m is None:
                raise ModelLoadError(f"no model {name!r}; `wafer models` lists them: "
                                     f"{', '.join(x.name for x in catalog.MODELS)}")
            chosen.append(m)
    if args.action == "install":
        from wafer.kernels import tuner

        shapes: dict = {}
        for m in chosen:
            path = catalog.install(m, log=lambda line: print(line, file=sys.stderr))
            if not args.no_prepare:  # convert once now, so that the first `wafer serve` starts in seconds
                tuner.add_shapes(shapes, load_with_progress(str(path), quiet=True, device="cpu").model)
            print(f"{m.name}: installed at {path}", file=sys.stderr)
        if not args.no_tune:  # the kernels' settings for this machine, timed on these models' shapes
            tuner.tune_installed(shapes if shapes else None, say=lambda line: print(line, file=sys.stderr))
        return 0
    failed = False
    for m in chosen:
        path = catalog.installed_path(m)
        if args.action == "verify" and path is not None:
            ok = catalog.sha256_of(path) == m.sha256
            failed |= not ok
            check = "sha256 verified now" if ok else "SHA-256 MISMATCH (reinstall: remove the file, `wafer models install`)"
        else:
            check = "sha256 verified at install" if path else "not installed"
        # 80 columns but for the paths, each on a line of its own
        print(f"{m.name}  " + (f"(tier {m.tier})" if m.tier else "(no tier: served when named)"))
        print(f"  file     {path or '-'}")
        print(f"  size     {m.size:,} bytes; {check}")
        print(f"  sha256   {m.sha256}")
        for i, line in enumerate(textwrap.wrap(m.source, 80 - 11)):
            print(f"  {'source' if i == 0 else '':<8} {line}")
        print(f"  license  {m.license}: {m.license_file}")
        if not m.calls_tools:
            print("  tools    does not call them on its own")
            if m.tier in NO_TOOL_CALLS:
                print(f"           {m.tier}'s tool_choice auto requests with tools go to {ROUTING_TIERS['tool_calls']}")
        elif not m.answers_tool_results:
            print("  tools    calls them, but calls again after their result instead of answering")
            if m.tier in NO_TOOL_RESULTS:
                print(f"           {m.tier}'s requests ending with a tool result go to {ROUTING_TIERS['tool_results']}")
    return 1 if failed else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from wafer.server.main import serve

    return serve(args)


def cmd_keys(args: argparse.Namespace) -> int:
    """Tenants' API keys in the state database: add (the key is printed once), list, revoke, usage."""
    from datetime import datetime, timedelta, timezone

    from wafer.server.key_store import KeyStore, Usage, describe, today

    store = KeyStore(args.state_db)
    try:
        if args.action == "add":
            if not args.ref:
                raise WaferError("wafer keys add TENANT: name the tenant the key is for")
            models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
            try:
                secret, key = store.add(args.ref, args.admin, args.rpm, args.tpm, args.concurrency, args.daily_tokens,
                                        models)
            except ValueError as e:
                raise WaferError(f"wafer keys add: {e}") from None
            print(secret)  # alone on stdout, for a script to take; shown this once only
            print(f"{key.id} for tenant {key.tenant}{' (admin)' if key.admin else ''}: {describe(key)}. The key is "
                  "not stored: keep it now.", file=sys.stderr)
            return 0
        if args.action == "list":
            keys = store.keys(revoked=args.all)
            for k in keys:
                made = datetime.fromtimestamp(k.created_at, timezone.utc).strftime("%Y-%m-%d %H:%M")
                state = "revoked" if k.revoked_at is not None else "live"
                print(f"{k.id}  {k.shown}…  tenant {k.tenant}{'  admin' if k.admin else ''}  {state}  made {made} UTC"
                      f"  {describe(k)}")
            if not keys:
                print("no keys (`wafer keys add TENANT` makes one)", file=sys.stderr)
            return 0
        if args.action == "revoke":
            if not args.ref:
                raise WaferError("wafer keys revoke KEY_ID|TENANT: name the key (its id) or the tenant")
            gone = store.revoke(args.ref)
            if not gone:
                raise WaferError(f"wafer keys revoke: no live key with id or tenant {args.ref!r}")
            for k in gone:
                print(f"revoked {k.id} of tenant {k.tenant}", file=sys.stderr)
            return 0
        since = (datetime.now(timezone.utc) - timedelta(days=max(args.days, 1) - 1)).strftime("%Y-%m-%d")
        rows = store.usage(since, args.ref)
        totals: dict[str, Usage] = {}
        print(f"{'day':<10}  {'tenant':<20}  {'key':<16}  {'requests':>8}  {'input':>10}  {'output':>10}  "
              f"{'errors':>6}  {'limited':>7}  {'cost USD':>10}")
        for day, key_id, u in rows:
            print(f"{day:<10}  {u.tenant:<20}  {key_id:<16}  {u.requests:>8}  {u.input_tokens:>10}  "
                  f"{u.output_tokens:>10}  {u.errors:>6}  {u.rate_limited:>7}  {u.cost_usd:>10.4f}")
            totals.setdefault(u.tenant, Usage(u.tenant)).add(u)
        for tenant, u in sorted(totals.items()):
            print(f"{'total':<10}  {tenant:<20}  {'':<16}  {u.requests:>8}  {u.input_tokens:>10}  "
                  f"{u.output_tokens:>10}  {u.errors:>6}  {u.rate_limited:>7}  {u.cost_usd:>10.4f}")
        print(f"(since {since}, today {today()} UTC; a running server writes its use every second)", file=sys.stderr)
        return 0
    finally:
        store.close()


def cmd_bench(args: argparse.Namespace) -> int:
    from wafer.benchmark.cli import main as bench_main

    return bench_main(args)


class _Help(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one worth saying (not None, off or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, [], argparse.SUPPRESS) or isinstance(action.default, bool) or "%(default)" in text:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="the most tokens generated")
    model_default = "default: the model's own, as `wafer info` shows and the server uses"
    p.add_argument("--temperature", type=float, default=None, help=model_default)
    p.add_argument("--top-p", type=float, default=None, help=model_default)
    p.add_argument("--top-k", type=int, default=None, help=model_default)
    p.add_argument("--min-p", type=float, default=None, help=model_default)
    p.add_argument("--repetition-penalty", type=float, default=None, help=model_default)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=EngineSettings.max_model_len, help="context to allocate")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or statistics")
    _quant_arg(p)


def _size(nbytes: int) -> str:
    """512MiB, 2GiB: a size as the flags take it."""
    return f"{nbytes / 2**30:g}GiB" if nbytes % 2**30 == 0 else f"{nbytes / 2**20:g}MiB"


def _non_negative(text: str) -> int:
    """An argparse type: refused before any model loads, with argparse's usage line."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _quant_arg(p: argparse.ArgumentParser) -> None:
    from wafer.models.quant import PATHS

    p.add_argument("--quant", choices=PATHS, default=LoadSettings.quant,
                   help="compute path (auto: the file's own weights on the CPU, q4 for the bundled model; "
                        "bf16 on CUDA): f32 (reference), bf16 (CUDA), int8 (int8 weights per channel, PyTorch's "
                        "kernel), q8 or q4 (8- or 4-bit blocks, wafer's kernels in the best variant the CPU runs, "
                        "WAFER_KERNELS=NAME forces one; int8 with a warning where they cannot be built)")
    p.add_argument("--device", choices=DEVICES, default=LoadSettings.device,
                   help="where the model runs (auto: cuda when a GPU is visible)")


def build_parser() -> argparse.ArgumentParser:
    """The `wafer` command's flags. Those of a setting take its default from wafer.config, and
    tests/config/test_defaults.py checks that each flag's default is its field's."""
    parser = argparse.ArgumentParser(prog="wafer", description="Serve and run LLMs (GGUF or Hugging Face).")
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = ("GGUF file, Hugging Face directory, or a model of `wafer models` by name or tier "
                  "(default: SmolLM2-135M-Instruct)")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_Help)

    g = command("generate", "complete a prompt, streaming to the terminal")
    g.add_argument("prompt")
    g.add_argument("--model", "-m", default=None, help=model_help)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    _sampling_args(g, 256)
    g.set_defaults(func=cmd_generate)

    c = command("chat", "interactive multi-turn chat")
    c.add_argument("model", nargs="?", default=None,
                   help=f"as for generate (default: the largest installed tier, {TIERS[0]} once installed)")
    c.add_argument("--system", default=None, help="system message")
    _sampling_args(c, 512)
    c.set_defaults(func=cmd_chat)

    i = command("info", "describe a model")
    i.add_argument("model", nargs="?", default=None, help=model_help)
    _quant_arg(i)
    i.set_defaults(func=cmd_info)

    s = command("serve", "OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", default=None,
                   help="GGUF file, Hugging Face directory, or a model of `wafer models` by name or tier (default: "
                        f"the tiers {', '.join(TIERS)}, each installed model serving its own)")
    s.add_argument("--host", default=ServerSettings.host, help="address to listen on")
    s.add_argument("--port", type=int, default=ServerSettings.port, help="port to listen on")
    s.add_argument("--api-key", action="append", default=[],
                   help="accepted bearer key (repeatable; visible to `ps`: prefer $WAFER_API_KEY, comma-separated, "
                        "or --api-key-file)")
    s.add_argument("--api-key-file", default=None, help="file of accepted bearer keys, one per line")
    s.add_argument("--state-db", default=None, metavar="PATH|URL",
                   help="where /v1/responses keeps stored responses, and the Batch API its files and batches: a "
                        "SQLite file, or a SQLAlchemy URL such as "
                        "postgresql://... for a store several servers share (default: state.db under "
                        "$WAFER_DATA_DIR, else ~/.local/share/wafer, made on first use)")
    s.add_argument("--max-file-bytes", type=int, default=ServerSettings.max_file_bytes, metavar="BYTES",
                   help="the largest file /v1/files takes (a Batch API input; OpenAI's limit, 200 MB)")
    s.add_argument("--protect-metrics", action="store_true",
                   help="/metrics and the dashboard's data need the API key too (default: open, as in vLLM)")
    s.add_argument("--max-running", type=int, default=EngineSettings.max_running, help="sequences decoded together")
    s.add_argument("--max-waiting", type=int, default=EngineSettings.max_waiting, help="queued requests before 429")
    s.add_argument("--max-model-len", type=int, default=EngineSettings.max_model_len,
                   help="context to allocate per sequence")
    s.add_argument("--max-batched-tokens", type=int, default=EngineSettings.max_batched_tokens,
                   help="tokens per engine step (prefill chunk)")
    s.add_argument("--prefill-step-ms", type=_non_negative, default=EngineSettings.prefill_step_ms, metavar="MS",
                   help="how long a step's prompt work may take while other streams wait for their next token "
                        "(learned per token; 0: only --max-batched-tokens bounds it)")
    s.add_argument("--grammar-ms-per-token", type=_non_negative, default=EngineSettings.grammar_ms_per_token,
                   metavar="MS", help="grammar work (masks, closing the JSON in time) a request with tools or a "
                   "response_format may take per token it generates, counting at least 50 (0: no limit); past "
                   "it the request ends alone with a 400, grammar_too_costly")
    s.add_argument("--kv-cache-dtype", default=CacheSettings.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="how keys and values are stored: int8 and fp8 (e4m3; CUDA, and the CPU's f32 and int8 "
                        "paths) have a scale per position and head (a quarter of f32's bytes); auto: bf16 on the "
                        "CPU's quantised paths, else the model's activation type")
    s.add_argument("--kv-cache-memory", default=CacheSettings.kv_cache_memory, metavar="SIZE",
                   help="KV-cache budget per model, e.g. 2GiB or 512MB (default: a quarter of the machine's memory, "
                        "or less when every running sequence fits at its whole context). Past it, new requests "
                        "wait and the latest running one is preempted and recomputed later")
    s.add_argument("--pipeline-parallel", type=int, default=EngineSettings.pipeline_parallel, metavar="N",
                   help="run each model's layers in N stage processes (torch.distributed, gloo), this one the "
                        "first; under torchrun the stages are its other ranks (see docs/guide/deployment.md)")
    limits, pool = ProgramLimits(), ProgramPoolSettings()
    # Model-written programs' limits: each flag over wafer.toml's [sandbox] key of its field, which
    # is over the default (shown here, from wafer/config/sandbox.py).
    s.add_argument(SANDBOX_FLAGS["memory_bytes"], dest="sandbox_memory_bytes", metavar="SIZE",
                   help="memory of one model-written program, e.g. 256MiB: its memory cgroup's limit, counting "
                        f"memfd, /tmp and page cache (default: {_size(limits.memory_bytes)})")
    s.add_argument(SANDBOX_FLAGS["cpu_seconds"], dest="sandbox_cpu_seconds", metavar="S",
                   help=f"CPU time of one program (default: {limits.cpu_seconds:g})")
    s.add_argument(SANDBOX_FLAGS["wall_seconds"], dest="sandbox_wall_seconds", metavar="S",
                   help=f"running time of one program, not counting time parked on tool calls (default: "
                        f"{limits.wall_seconds:g})")
    s.add_argument(SANDBOX_FLAGS["max_running"], dest="sandbox_max_running", metavar="N",
                   help="programs running at once; a request that would start one more gets a 429, programs_busy "
                        f"(default: {pool.max_running})")
    s.add_argument(SANDBOX_FLAGS["max_parked"], dest="sandbox_max_parked", metavar="N",
                   help=f"programs parked waiting for tool outputs; one more ends with an error (default: "
                        f"{pool.max_parked})")
    s.add_argument(SANDBOX_FLAGS["parked_memory_bytes"], dest="sandbox_parked_memory_bytes", metavar="SIZE",
                   help=f"memory the parked programs hold together (default: {_size(pool.parked_memory_bytes)})")
    s.add_argument("--served-model-name", action="append", default=[], help="name(s) clients use (repeatable)")
    _quant_arg(s)
    s.add_argument("--config", default=None, help="TOML file with models, tiers, aliases, upstreams and routing")
    s.add_argument("--speculative", default=SpeculationSettings.speculative,
                   metavar="off|ngram|suffix|draft:MODEL|auto",
                   help="speculative decoding: n-gram prompt lookup, suffix drafts (the request's own text and "
                        "earlier outputs, by frequency), a draft model (a path, or a model or tier of --config) "
                        "with the same tokenizer, or several joined by commas (auto: ngram,suffix; e.g. "
                        "auto,draft:terra), the engine picking per sequence and step")
    s.add_argument("--num-speculative-tokens", type=int, default=SpeculationSettings.num_speculative_tokens,
                   help="K, the most tokens proposed a step")
    s.add_argument("--speculative-length", choices=SPECULATIVE_LENGTHS, default=SpeculationSettings.speculative_length,
                   help="adaptive: each step proposes the number of tokens, up to K and none included, "
                        "that measured steps show to decode fastest; fixed: always K")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   default=CacheSettings.prefix_caching, help="never reuse the KV of earlier prompts")
    s.add_argument("--shutdown-grace", type=float, default=ServerSettings.shutdown_grace,
                   help="seconds running requests get on SIGTERM")
    s.add_argument("--keep-alive", type=float, default=ServerSettings.keep_alive,
                   help="seconds an idle connection is kept open (longer than clients' pools, which then close "
                        "first)")
    s.add_argument("--log-level", default=ServerSettings.log_level, help="debug, info, warning or error")
    s.add_argument("--otlp-endpoint", default=ServerSettings.otlp_endpoint, metavar="URL",
                   help="send each request's OpenTelemetry trace to this OTLP/HTTP collector, e.g. "
                        "http://localhost:4318 (default: off, unless $OTEL_EXPORTER_OTLP_ENDPOINT or "
                        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set)")
    s.set_defaults(func=cmd_serve)

    mo = command("models", "the models wafer serves by default: list, install, verify")
    mo.add_argument("action", nargs="?", choices=["list", "install", "verify"], default="list",
                    help="list: what is installed, where, its size, checksum and licence; install: fetch, "
                         "assemble and check them; verify: hash the installed files again")
    mo.add_argument("names", nargs="*", help="models by name or tier (default: all)")
    mo.add_argument("--no-prepare", action="store_true",
                    help="install only: do not convert the weights for the default compute path now")
    mo.add_argument("--no-tune", action="store_true",
                    help="install only: do not time the kernels' settings for this machine on these models now "
                         "(python -m wafer.kernels --tune does it later)")
    mo.set_defaults(func=cmd_models)

    k = command("keys", "tenants' API keys, with their limits, in the state database")
    k.add_argument("action", choices=["add", "list", "revoke", "usage"],
                   help="add: make a key for a tenant and print it (once: only its hash is kept); list: the keys; "
                        "revoke: a key by id, or every key of a tenant (refused at once, by running servers too); "
                        "usage: requests, tokens, errors and cost by day, tenant and key")
    k.add_argument("ref", nargs="?", default=None, metavar="TENANT|KEY_ID",
                   help="add: the tenant; revoke: a key id or a tenant; usage: only this tenant")
    k.add_argument("--state-db", default=None, metavar="PATH|URL",
                   help="the state database, as for `wafer serve --state-db`")
    k.add_argument("--admin", action="store_true", help="add: the key may read /metrics and the dashboard")
    k.add_argument("--rpm", type=int, default=None, help="add: requests per minute")
    k.add_argument("--tpm", type=int, default=None, help="add: tokens (prompt and completion) per minute")
    k.add_argument("--concurrency", type=int, default=None, help="add: requests at once")
    k.add_argument("--daily-tokens", type=int, default=None, help="add: tokens per UTC day")
    k.add_argument("--models", default=None, metavar="NAME,NAME",
                   help="add: the only model names (or aliases of them) the key may ask for")
    k.add_argument("--all", action="store_true", help="list: revoked keys too")
    k.add_argument("--days", type=int, default=7, help="usage: this many days back, today included")
    k.set_defaults(func=cmd_keys)

    from wafer.benchmark.cli import add_arguments

    b = command("bench", "load-test an OpenAI-compatible endpoint")
    add_arguments(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except WaferError as e:
        print(f"wafer: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
