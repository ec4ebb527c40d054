"""Shared pieces of the benchmark scripts: the prompt, timing, the table."""

from __future__ import annotations

import time

PROMPT = "Write a detailed story about a lonely old lighthouse keeper."  # 41 tokens in the chat template


def now() -> float:
    return time.perf_counter()


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
