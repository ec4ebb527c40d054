"""Show and save a benchmark: a terminal table, JSON, a Markdown report and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from wafer.benchmark.stats import FORMULAS

COLUMNS = [
    ("in", lambda c: c["input_len"]),
    ("out", lambda c: c["output_len"]),
    ("conc", lambda c: c["concurrency"] if c["concurrency"] is not None else "-"),
    ("rate", lambda c: c["request_rate"]),
    ("ok/sent", lambda c: f"{c['completed']}/{c['requests']}"),
    ("req/s", lambda c: f"{c['request_throughput']:.2f}"),
    ("out tok/s", lambda c: f"{c['output_throughput']:.1f}"),
    ("tok/s/stream p50", lambda c: _ms(c["output_speed_per_stream"]["p50"], 1, 1)),
    ("TTFT p50 ms", lambda c: _ms(c["ttft_s"]["p50"])),
    ("TTFT p95 ms", lambda c: _ms(c["ttft_s"]["p95"])),
    ("TPOT p50 ms", lambda c: _ms(c["tpot_s"]["p50"])),
    ("ITL p95 ms", lambda c: _ms(c["itl_s"]["p95"])),
    ("E2E p50 s", lambda c: _ms(c["e2e_s"]["p50"], 1, 2)),
    ("E2E p99 s", lambda c: _ms(c["e2e_s"]["p99"], 1, 2)),
    ("goodput", lambda c: "-" if c["goodput"] is None else f"{c['goodput']:.2f}"),
    ("spec accept len", lambda c: "-" if c.get("spec_acceptance_length") is None
     else f"{c['spec_acceptance_length']:.2f}"),
    ("errors", lambda c: ", ".join(f"{k}: {v}" for k, v in c["errors"].items()) or "0"),
]


def _ms(v: float | None, scale: float = 1000, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def terminal_table(cells: list[dict[str, Any]], console: Console) -> None:
    """A table where it fits the terminal; else each cell as a column of `name: value` lines (as
    vLLM's bench prints), rather than a table of cut columns."""
    rows = [[str(f(c)) for _, f in COLUMNS] for c in cells]
    widths = [max([len(name), *(len(r[k]) for r in rows)]) for k, (name, _) in enumerate(COLUMNS)]
    if sum(widths) + 3 * len(widths) + 1 > console.width:
        label = max(len(name) for name, _ in COLUMNS)
        for n, row in enumerate(rows):
            console.print(f"{'=' * 10} wafer bench, cell {n + 1} of {len(rows)} {'=' * 10}")
            for (name, _), value in zip(COLUMNS, row):
                console.print(f"{name:<{label}}  {value}", highlight=False)
        return
    t = Table(title="wafer bench")
    for name, _ in COLUMNS:
        t.add_column(name, justify="right")
    for row in rows:
        t.add_row(*row)
    console.print(t)


def markdown(meta: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    lines = [f"# wafer bench: {meta['model']} at {meta['base_url']}", "",
             f"Endpoint `{meta['endpoint']}`, {meta['num_prompts']} prompts per cell, warm-up {meta['warmup']}, "
             f"seed {meta['seed']}, ignore_eos {meta['ignore_eos']}, started {meta['started']}.", ""]
    lines.append("| " + " | ".join(n for n, _ in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for c in cells:
        lines.append("| " + " | ".join(str(f(c)) for _, f in COLUMNS) + " |")
    if any(c.get("cost_per_request") is not None for c in cells):
        lines += ["", "| in | out | conc | cost / request | cost / 1k requests |", "|---|---|---|---|---|"]
        for c in cells:
            lines.append(f"| {c['input_len']} | {c['output_len']} | {c['concurrency']} | "
                         f"{c['cost_per_request']:.6f} | {c['cost_per_1k_requests']:.4f} |")
    fallbacks = sum(c["token_count_fallbacks"] for c in cells)
    mismatches = sum(c["token_count_mismatches"] for c in cells)
    lines += ["", f"Token counts from the server's usage; client-tokenizer fallbacks: {fallbacks}, "
                  f"mismatches with the client's count of the text: {mismatches}.", ""]
    lines += ["```", FORMULAS, "```", ""]
    return "\n".join(lines)


def plots(cells: list[dict[str, Any]], records: dict[int, list[float]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["input_len"], c["output_len"]), []).append(c)
    for metric, ylabel, fname in (("output_throughput", "output tokens/s", "throughput_vs_concurrency.png"),
                                  ("ttft_p50", "TTFT p50 (s)", "ttft_vs_concurrency.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (i, o), cs in sorted(groups.items()):
            cs = sorted(cs, key=lambda c: c["concurrency"] or 0)
            xs = [c["concurrency"] or 0 for c in cs]
            ys = [c[metric] if metric in c else c["ttft_s"]["p50"] for c in cs]
            ax.plot(xs, ys, marker="o", label=f"in {i} / out {o}")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)
    fig, ax = plt.subplots(figsize=(6, 4))
    for idx, e2es in records.items():
        c = cells[idx]
        if e2es:
            ax.hist(e2es, bins=20, alpha=0.5, label=f"in {c['input_len']} out {c['output_len']} conc {c['concurrency']}")
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("requests")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_histogram.png", dpi=110)
    plt.close(fig)
    paths.append(out / "latency_histogram.png")
    return paths


def save(out: Path, meta: dict[str, Any], cells: list[dict[str, Any]], e2e_by_cell: dict[int, list[float]]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "cells": cells, "formulas": FORMULAS}, indent=2))
    (out / "report.md").write_text(markdown(meta, cells))
    return [out / "results.json", out / "report.md", *plots(cells, e2e_by_cell, out)]
