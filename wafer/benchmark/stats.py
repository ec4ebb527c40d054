"""The arithmetic of a benchmark cell, with vLLM's `bench serve` definitions."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from wafer.benchmark.client import RequestRecord
from wafer.models.tokenizer import TextTokenizer

FORMULAS = """\
Metrics (per request, then mean / std / p50 / p90 / p95 / p99 over requests):
  TTFT   = time of the first non-empty content chunk - time the request was sent
  E2E    = time of the last content chunk - time the request was sent
  TPOT   = (E2E - TTFT) / (output_tokens - 1)            (requests with >= 2 output tokens)
  ITL    = every gap between successive content chunks, pooled over all requests
  output speed per stream = (output_tokens - 1) / (E2E - TTFT)   (after the first token)
Per cell:
  output throughput = sum(output_tokens) / duration;  total = sum(input + output tokens) / duration
  requests/s = completed / duration;  requests/min = 60 * requests/s
  goodput    = requests meeting every --slo bound / duration
  cost/request = (input_tokens * price_in + output_tokens * price_out) / 1e6;  per 1k requests = 1000x
  spec accept len = 1 + accepted / drafts over the cell, from the server's /metrics speculative-decoding
                    counters (wafer: or vllm: names) read before and after it; "-" when it has none
Token counts come from the server's `usage` (stream_options.include_usage); when it is missing, the
client tokenizer counts the text (a fallback), and requests where both exist but differ are mismatches."""

PERCENTILES = (50, 90, 95, 99)


def summarise(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    s = sorted(values)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "std": statistics.pstdev(s) if len(s) > 1 else 0.0,
            **{f"p{p}": pct(p) for p in PERCENTILES}}


@dataclass
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "SLO | None":
        if not text:
            return None
        slo = cls()
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"unknown SLO {key!r}: use ttft=MS,tpot=MS,e2e=MS")
            setattr(slo, f"{key}_ms", float(value))
        return slo

    def met(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        checks = ((self.ttft_ms, ttft), (self.tpot_ms, tpot), (self.e2e_ms, e2e))
        return all(bound is None or (v is not None and v * 1000 <= bound) for bound, v in checks)


def cell_stats(records: list[RequestRecord], duration: float, tokenizer: TextTokenizer | None,
               slo: SLO | None = None, price: tuple[float, float] | None = None) -> dict:
    ok = [r for r in records if r.ok]
    ttfts, e2es, tpots, itls, speeds = [], [], [], [], []
    in_tokens, out_tokens = [], []
    fallback = mismatches = good = 0
    for r in ok:
        client_count = len(tokenizer.encode(r.text, add_special_tokens=False)) if tokenizer else None
        if r.usage_completion is not None:
            out = r.usage_completion
            if client_count is not None and client_count != out:
                mismatches += 1
        else:
            out = client_count if client_count is not None else len(r.chunk_times)
            fallback += 1
        n_in = r.usage_prompt if r.usage_prompt is not None else (r.input_len or 0)
        in_tokens.append(n_in)
        out_tokens.append(out)
        ttft, e2e = r.ttft, r.e2e
        ttfts.append(ttft)
        e2es.append(e2e)
        tpot = (e2e - ttft) / (out - 1) if out > 1 and e2e > ttft else None
        if tpot is not None:
            tpots.append(tpot)
            speeds.append((out - 1) / (e2e - ttft))
        itls.extend(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]))
        if slo is not None and slo.met(ttft, tpot, e2e):
            good += 1
    errors = Counter(f"{r.status} {r.error_type}" for r in records if not r.ok)
    dur = max(duration, 1e-9)
    stats = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors),
        "duration_s": duration,
        "input_tokens": sum(in_tokens),
        "output_tokens": sum(out_tokens),
        "request_throughput": len(ok) / dur,
        "requests_per_minute": 60 * len(ok) / dur,
        "output_throughput": sum(out_tokens) / dur,
        "total_token_throughput": (sum(in_tokens) + sum(out_tokens)) / dur,
        "goodput": (good / dur) if slo is not None else None,
        "ttft_s": summarise(ttfts),
        "tpot_s": summarise(tpots),
        "itl_s": summarise(itls),
        "e2e_s": summarise(e2es),
        "output_speed_per_stream": summarise(speeds),
        "token_count_fallbacks": fallback,
        "token_count_mismatches": mismatches,
    }
    if price is not None:
        costs = [(i * price[0] + o * price[1]) / 1e6 for i, o in zip(in_tokens, out_tokens)]
        stats["cost_per_request"] = statistics.fmean(costs) if costs else None
        stats["cost_per_1k_requests"] = 1000 * stats["cost_per_request"] if costs else None
    return stats
