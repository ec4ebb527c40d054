"""Send one streamed request and time every content chunk."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import httpx

from wafer.benchmark.workload import Prompt


@dataclass
class RequestRecord:
    start: float  # perf_counter at send
    input_len: int | None
    output_len_requested: int
    ok: bool = False
    status: int = 0
    error_type: str | None = None
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each non-empty content chunk
    text: str = ""
    end: float | None = None
    usage_prompt: int | None = None
    usage_completion: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return (self.end - self.start) if self.end is not None else None


async def send(session: aiohttp.ClientSession, base_url: str, endpoint: str, model: str, prompt: Prompt,
               api_key: str | None, ignore_eos: bool, timeout: float, extra: dict | None = None) -> RequestRecord:
    body: dict = {"model": model, "max_tokens": prompt.output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": 0}
    if endpoint == "responses":  # the output budget covers reasoning and, under Ultra, the synthesis
        url = base_url.rstrip("/") + "/responses"
        body = {"model": model, "input": prompt.text, "max_output_tokens": prompt.output_len, "stream": True,
                "temperature": 0, **(extra or {})}
    elif endpoint == "chat":
        url = base_url.rstrip("/") + "/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        url = base_url.rstrip("/") + "/completions"
        body["prompt"] = prompt.text
    if ignore_eos and endpoint != "responses":
        body["ignore_eos"] = True
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    rec = RequestRecord(time.perf_counter(), prompt.input_len, prompt.output_len)
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            rec.status = r.status
            if r.status != 200:
                raw = await r.read()
                try:
                    err = json.loads(raw)["error"]
                    rec.error_type, rec.error = err.get("type"), err.get("message")
                except (ValueError, KeyError, TypeError):
                    rec.error_type, rec.error = "http_error", raw[:200].decode(errors="replace")
                rec.end = time.perf_counter()
                return rec
            # While the stream runs, only split it into events and stamp each with its arrival: the
            # JSON is parsed after the last byte, so that on a machine shared with the server the
            # measuring costs the server as little CPU as it can.
            events: list[tuple[float, bytes]] = []
            pending = b""
            async for data in r.content.iter_any():
                now = time.perf_counter()
                pending = (pending + data).replace(b"\r\n", b"\n")
                *done, pending = pending.split(b"\n\n")
                events.extend((now, e) for e in done)
                if done and done[-1].strip() == b"data: [DONE]":
                    break
            if pending.strip():
                events.append((time.perf_counter(), pending))
            if _read_events(rec, events, endpoint):
                return rec
        rec.end = rec.chunk_times[-1] if rec.chunk_times else time.perf_counter()
        rec.ok = bool(rec.chunk_times)
        if not rec.ok:
            rec.error_type, rec.error = "empty_response", "the stream carried no content"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.status = rec.status or 0
        rec.error_type, rec.error = type(e).__name__, str(e) or type(e).__name__
        rec.end = time.perf_counter()
    return rec


def _read_events(rec: RequestRecord, events: list[tuple[float, bytes]], endpoint: str) -> bool:
    """Fold a stream's timed events into the record; True when one was an error (the record ends there)."""
    for at, event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # ': ping' comments, event names
            data = line[5:].strip()
            if data == b"[DONE]":
                return False
            obj = json.loads(data)
            if endpoint == "responses":
                if _read_response_event(rec, obj, at):
                    return True
                continue
            if "error" in obj:
                rec.error_type = obj["error"].get("type") or "stream_error"
                rec.error = obj["error"].get("message")
                rec.end = at
                return True
            if obj.get("usage"):
                rec.usage_prompt = obj["usage"].get("prompt_tokens")
                rec.usage_completion = obj["usage"].get("completion_tokens")
            for choice in obj.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                if piece:
                    rec.chunk_times.append(at)
                    rec.text += piece
    return False


def _read_response_event(rec: RequestRecord, obj: dict, at: float) -> bool:
    """One event of /v1/responses into the record; True for an error. The answer's text times the
    tokens (reasoning and sub-agents' work come before it, as its TTFT shows)."""
    kind = obj.get("type")
    if kind == "response.output_text.delta" and obj.get("delta"):
        rec.chunk_times.append(at)
        rec.text += obj["delta"]
    elif kind in ("response.completed", "response.incomplete"):
        usage = (obj.get("response") or {}).get("usage") or {}
        rec.usage_prompt, rec.usage_completion = usage.get("input_tokens"), usage.get("output_tokens")
    elif kind in ("error", "response.failed"):
        err = obj if kind == "error" else ((obj.get("response") or {}).get("error") or {})
        rec.error_type, rec.error = err.get("code") or "stream_error", err.get("message")
        rec.end = at
        return True
    return False


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens")


def spec_counters(base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its Prometheus `/metrics` (wafer's or vLLM's
    names), summed over models; None when it has none or no /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(root + "/metrics", headers=headers, timeout=10)
        if r.status_code != 200:
            return None
        totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
        found = False
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                name = s.name.split(":", 1)[-1].removesuffix("_total")
                if name in totals and s.name.endswith("_total"):
                    totals[name] += s.value
                    found = True
        return totals if found else None
    except (httpx.HTTPError, ValueError):
        return None


def acceptance_length(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Mean tokens per verifying step between two readings (1 + accepted / drafts), as vLLM reports it."""
    if before is None or after is None:
        return None
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return 1 + accepted / drafts if drafts > 0 else None
