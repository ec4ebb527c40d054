"""`wafer bench`: arguments, the sweep over cells, and the outputs."""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from wafer.benchmark.client import acceptance_length, spec_counters
from wafer.benchmark.report import save, terminal_table
from wafer.benchmark.runner import LoadConfig, run_async, run_load
from wafer.benchmark.stats import FORMULAS, SLO, cell_stats
from wafer.benchmark.workload import from_jsonl, synthetic
from wafer.errors import WaferError


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The epilog's formulas as written, and each option's default after its help: argparse's own
    ArgumentDefaultsHelpFormatter would also print "(default: None)" and "(default: False)", where
    the help says in words what an unset option does."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = FORMULAS
    p.formatter_class = _HelpFormatter
    # A list's default is written as its flag would be (argparse passes a string default through `type`),
    # so that --help shows it as one types it.
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint's /v1 URL")
    p.add_argument("--api-key", default=None,
                   help="bearer key, visible to `ps` (default: --api-key-file's, else the first of $WAFER_API_KEY, "
                        "else none)")
    p.add_argument("--api-key-file", type=Path, default=None, help="a file whose first line is the bearer key")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["chat", "completions", "responses"], default="chat",
                   help="which API to load")
    p.add_argument("--mode", choices=["direct", "ultra", "max"], default="direct",
                   help="with --endpoint responses: plain, Ultra (sub-agents) or Max (a reasoning budget)")
    p.add_argument("--subagents", type=int, default=4, help="Ultra's sub-agents (--mode ultra)")
    p.add_argument("--effort", default="high", help="reasoning.effort for --mode max")
    p.add_argument("--input-len", type=_ints, default="128", help="prompt tokens; a list sweeps, e.g. 128,1024")
    p.add_argument("--output-len", type=_ints, default="128", help="max tokens; a list sweeps")
    p.add_argument("--dataset", type=Path, default=None,
                   help="JSONL with 'prompt' (or 'messages') per line (default: synthetic prompts)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per cell")
    p.add_argument("--warmup", type=int, default=1, help="requests sent before each cell, not counted")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and of the arrivals")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to run to --output-len")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of identical prefix across prompts (0: every prompt is unique)")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="concurrent clients; a list sweeps (default: unbounded, every request sent as "
                        "--request-rate allows)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default: no pacing)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds per cell (a soak); prompts cycle (default: each prompt once)")
    p.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=500,tpot=50 (milliseconds; default: none)")
    p.add_argument("--price-per-mtok", default=None,
                   help="IN,OUT prices per million tokens, for cost (default: no cost)")
    p.add_argument("--tokenizer", default=None, help="GGUF or HF directory for prompt building and token counts "
                                                     "(default: the bundled model's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--out", type=Path, default=None,
                   help="write results.json, report.md and PNG plots here (default: only the table)")


def bearer_key(args: argparse.Namespace, env: dict[str, str] | None = None) -> str | None:
    """The key the load is sent with: --api-key, --api-key-file's first line, the first key of
    $WAFER_API_KEY (as `wafer serve` reads it), or none."""
    if args.api_key:
        return args.api_key
    if args.api_key_file is not None:
        try:
            lines = [line.strip() for line in args.api_key_file.read_text().splitlines()]
        except OSError as e:
            raise WaferError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
        key = next((line for line in lines if line and not line.startswith("#")), None)
        if key is None:
            raise WaferError(f"--api-key-file {args.api_key_file}: no key in it")
        return key
    env = os.environ if env is None else env
    return next((k.strip() for k in env.get("WAFER_API_KEY", "").split(",") if k.strip()), None)


def _default_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def main(args: argparse.Namespace) -> int:
    from wafer.models.loader import load_tokenizer

    # The table is the result and goes to stdout, so that `wafer bench ... > file` keeps it; the progress
    # bar and the paths written are diagnostics, on stderr.
    console = Console(stderr=True)
    tokenizer = load_tokenizer(args.tokenizer)
    args.api_key = bearer_key(args)
    model = args.model or _default_model(args.base_url, args.api_key)
    slo = SLO.parse(args.slo)
    price = tuple(float(x) for x in args.price_per_mtok.split(",")) if args.price_per_mtok else None
    concurrencies = args.concurrency or [None]
    cells = []
    e2e_by_cell: dict[int, list[float]] = {}
    started = datetime.datetime.now().isoformat(timespec="seconds")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for in_len in ([None] if args.dataset else args.input_len):
            for out_len in args.output_len:
                for conc in concurrencies:
                    seed = args.seed + len(cells) * 7919  # fresh prompts per cell: no cache hits across cells
                    if args.dataset:
                        prompts = from_jsonl(args.dataset, args.num_prompts + args.warmup, out_len, tokenizer)
                    else:
                        prompts = synthetic(tokenizer, args.num_prompts + args.warmup, in_len, out_len, seed,
                                            args.shared_prefix)
                    cfg = LoadConfig(args.base_url, model, args.endpoint, args.api_key, conc, args.request_rate,
                                     args.burstiness, args.duration, args.ignore_eos, args.timeout, seed,
                                     args.mode, args.subagents, args.effort)
                    if args.warmup:
                        warm = LoadConfig(**{**cfg.__dict__, "duration": None, "request_rate": float("inf")})
                        run_async(run_load(warm, prompts[: args.warmup]))
                    label = f"in {in_len or 'dataset'} out {out_len} conc {conc or '-'}"
                    spec_before = spec_counters(args.base_url, args.api_key)
                    records, duration = run_async(run_load(cfg, prompts[args.warmup:], progress, label))
                    stats = cell_stats(records, duration, tokenizer, slo, price)  # type: ignore[arg-type]
                    stats["spec_acceptance_length"] = acceptance_length(
                        spec_before, spec_counters(args.base_url, args.api_key))
                    mean_in = (stats["input_tokens"] / stats["completed"]) if stats["completed"] else None
                    cells.append({"input_len": in_len if in_len is not None else round(mean_in or 0),
                                  "output_len": out_len, "concurrency": conc,
                                  "request_rate": args.request_rate, **stats})
                    e2e_by_cell[len(cells) - 1] = [r.e2e for r in records if r.ok and r.e2e is not None]
    terminal_table(cells, Console())
    if args.out:
        meta = {"model": model, "base_url": args.base_url, "endpoint": args.endpoint, "mode": args.mode,
                "num_prompts": args.num_prompts, "warmup": args.warmup, "seed": args.seed,
                "ignore_eos": args.ignore_eos, "started": started, "burstiness": args.burstiness,
                "shared_prefix": args.shared_prefix, "slo": args.slo}
        for path in save(args.out, meta, cells, e2e_by_cell):
            console.print(f"wrote {path}", soft_wrap=True, highlight=False)  # a path whole, to copy
    return 0 if all(c["completed"] for c in cells) else 1
