"""A fuzz run against a live server: generated requests (bench/fuzz_requests.py) sent from a few
threads at once, every answer checked, the server's event-loop stalls read from /metrics before and
after, and its health after. tests/server/test_fuzz.py and bench/fuzz.py both run it.

What every answer must be:
- no 5xx, and no error event of type `server_error` inside a 200 stream (the status a stream could not
  send);
- an error (status 400 and up, or an error event in a stream) shaped exactly
  `{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}`;
- a JSON answer that parses; a stream whose events parse and that ends in `[DONE]` or an error event (a
  /v1/responses stream: numbered typed events ending in one terminal event, an `error` event only before
  `response.failed`);
- complete within `bound` seconds, on a connection the server did not drop.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from prometheus_client.parser import text_string_to_metric_families

from bench.common import table
from bench.fuzz_requests import FuzzRequest, generators, quotas

STALL_LIMIT = 0.1  # issue 19: no request may hold the loop, and so delay another's stream, longer


@dataclass
class Outcome:
    request: FuzzRequest
    source: str  # the generator that made it (a key of fuzz_requests.WEIGHTS)
    status: str  # the HTTP status, "200 stream-error CODE", or what happened instead ("timeout", ...)
    seconds: float
    problem: str | None = None
    stall: float | None = None  # the longest loop stall while it ran (at most, see LoopStalls); sequential runs only


@dataclass
class LoopStalls:
    """The server's wafer:event_loop_* series at one moment."""

    longest: float  # the gauge: the longest stall since the server started
    buckets: dict[float, float]  # histogram: upper bound -> observations at or below it (cumulative)
    # wafer:engine_step_seconds by kind (prompt, decode), every model's together: upper bound ->
    # steps at or below it (cumulative). An engine step holds the loop, so it is one cause of a stall.
    steps: dict[str, dict[float, float]] = field(default_factory=dict)

    def over(self, earlier: LoopStalls, limit: float = STALL_LIMIT) -> int:
        """Stalls longer than `limit` (a bucket bound) observed since `earlier`."""
        total = self.buckets[float("inf")] - earlier.buckets[float("inf")]
        return int(total - (self.buckets[limit] - earlier.buckets[limit]))

    def steps_within(self, earlier: LoopStalls, kind: str, bound: float) -> int:
        """Engine steps of `kind` since `earlier` that took at most `bound` seconds (a bucket bound)."""
        return int(self.steps.get(kind, {}).get(bound, 0.0) - earlier.steps.get(kind, {}).get(bound, 0.0))

    def steps_over(self, earlier: LoopStalls, kind: str, limit: float = STALL_LIMIT) -> int:
        """Engine steps of `kind` longer than `limit` (a bucket bound) since `earlier`."""
        return self.steps_within(earlier, kind, float("inf")) - self.steps_within(earlier, kind, limit)

    def longest_since(self, earlier: LoopStalls) -> tuple[float, bool]:
        """The longest stall since `earlier` and whether that is exact: it is when it set a new maximum;
        otherwise the upper bound of the histogram bucket it fell in."""
        if self.longest > earlier.longest:
            return self.longest, True
        total = self.buckets[float("inf")] - earlier.buckets[float("inf")]
        bounds = [le for le in sorted(self.buckets) if self.buckets[le] - earlier.buckets.get(le, 0.0) == total]
        return bounds[0], False


def _is_5xx(o: Outcome) -> bool:
    return o.status.startswith("5") or "stream-error server_error" in o.status


def _is_malformed(o: Outcome) -> bool:
    return o.problem is not None and "error shape" in o.problem


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    seed: int = 0
    before: LoopStalls | None = None
    after: LoopStalls | None = None
    healthy: str | None = None  # None if healthy afterwards, else what failed

    @property
    def counts(self) -> Counter[str]:
        return Counter(o.status for o in self.outcomes)

    @property
    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    @property
    def server_errors(self) -> int:
        return sum(1 for o in self.outcomes if _is_5xx(o))

    @property
    def malformed(self) -> int:
        return sum(1 for o in self.outcomes if _is_malformed(o))

    @property
    def other_problems(self) -> int:
        """Timeouts, dropped connections, broken streams: problems neither 5xx nor malformed."""
        return sum(1 for o in self.outcomes if o.problem and not _is_5xx(o) and not _is_malformed(o))

    def stalls_during(self) -> int:
        """Stalls longer than STALL_LIMIT during the run."""
        assert self.before is not None and self.after is not None
        return self.after.over(self.before)

    def slow_steps(self) -> int:
        """Engine steps longer than STALL_LIMIT during the run: each held the loop that long, though
        the timer sees a hold only from when it was due (up to its 50 ms interval less)."""
        assert self.before is not None and self.after is not None
        return sum(self.after.steps_over(self.before, k) for k in ("prompt", "decode"))

    def step_spread(self, kind: str) -> str:
        """How many steps of `kind` fell in each bucket of wafer:engine_step_seconds from 25 ms up."""
        assert self.before is not None and self.after is not None
        bounds = [b for b in sorted(self.after.steps.get(kind, {})) if b >= 0.025]
        parts, low = [], 0.0
        for b in bounds:
            n = self.after.steps_within(self.before, kind, b) - (self.after.steps_within(self.before, kind, low) if low else 0)
            label = f"<= {b * 1000:.0f}" if not low else (f"> {low * 1000:.0f}" if b == float("inf") else f"{low * 1000:.0f}-{b * 1000:.0f}")
            parts.append(f"{label}: {n}")
            low = b
        return ", ".join(parts) or "none"

    def longest_stall(self) -> str:
        assert self.before is not None and self.after is not None
        seconds, exact = self.after.longest_since(self.before)
        if exact:
            return f"{seconds * 1000:.1f} ms"
        return f"<= {seconds * 1000:.0f} ms (below the earlier maximum {self.before.longest * 1000:.1f} ms)"

    def summary(self) -> str:
        """The figures as printed by the test and the bench: counts by status, then the totals."""
        rows = [[status, str(n)] for status, n in sorted(self.counts.items())]
        by_source = Counter(o.source for o in self.outcomes)
        totals = [
            ["requests", str(len(self.outcomes))],
            ["seconds", f"{self.seconds:.1f}"],
            ["seed", str(self.seed)],
            ["5xx (incl. server_error in a stream)", str(self.server_errors)],
            ["malformed error bodies", str(self.malformed)],
            ["other problems (timeouts, dropped connections, bad streams)", str(self.other_problems)],
            ["longest event-loop stall", self.longest_stall()],
            [f"stalls over {STALL_LIMIT * 1000:.0f} ms", str(self.stalls_during())],
            [f"engine steps over {STALL_LIMIT * 1000:.0f} ms (prompt / decode)",
             " / ".join(str(self.after.steps_over(self.before, k)) for k in ("prompt", "decode"))],
            ["prompt steps by wall time (ms)", self.step_spread("prompt")],
            ["healthy afterwards", "yes" if self.healthy is None else f"NO: {self.healthy}"],
        ]
        sources = ", ".join(f"{k} {n}" for k, n in sorted(by_source.items()))
        return "\n".join([table(["status", "count"], rows), "", table(["", ""], totals), "", f"generators: {sources}"])


def error_shape_problem(obj: Any) -> str | None:
    """None when `obj` is exactly an OpenAI error body, else what is wrong with it."""
    if not isinstance(obj, dict) or set(obj) != {"error"} or not isinstance(obj["error"], dict):
        return f"error shape: top level is not exactly {{'error': {{...}}}}: {str(obj)[:200]}"
    e = obj["error"]
    if set(e) != {"message", "type", "param", "code"}:
        return f"error shape: keys {sorted(e)}, not message/type/param/code"
    if not isinstance(e["message"], str) or not isinstance(e["type"], str):
        return f"error shape: message or type not a string: {str(e)[:200]}"
    if not (e["param"] is None or isinstance(e["param"], str)) or not (e["code"] is None or isinstance(e["code"], str)):
        return f"error shape: param or code neither a string nor null: {str(e)[:200]}"
    return None


def judge(status: int, content_type: str, body: bytes) -> tuple[str, str | None]:
    """(the status as counted, the problem or None) of one complete answer."""
    if status >= 500:
        try:
            shape = error_shape_problem(json.loads(body))
        except ValueError:
            shape = "error shape: not JSON"
        return str(status), f"{status}" + (f"; {shape}" if shape else f": {body[:300]!r}")
    if status >= 400:
        try:
            return str(status), error_shape_problem(json.loads(body))
        except ValueError:
            return str(status), f"error shape: not JSON: {body[:200]!r}"
    if content_type.startswith("text/event-stream"):
        return _judge_stream(status, body)
    if content_type.startswith("application/json"):
        try:
            json.loads(body)
        except ValueError:
            return str(status), f"a {status} answer that is not JSON: {body[:200]!r}"
    return str(status), None


# How a Responses stream may end: its terminal events.
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def _judge_responses_stream(status: int, events: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A /v1/responses stream: typed events numbered from 0, ending in one terminal event; an `error`
    event (OpenAI's: type, code, message, param) only right before `response.failed`."""
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        return str(status), "responses stream: sequence numbers are not 0, 1, 2, ..."
    last = events[-1]
    if last.get("type") not in RESPONSE_ENDS:
        return str(status), f"responses stream ends with {str(last.get('type'))[:80]!r}, not a terminal event"
    if any(e.get("type") in RESPONSE_ENDS for e in events[:-1]):
        return str(status), "responses stream: events after its terminal event"
    errors = [e for e in events if e.get("type") == "error"]
    if errors:
        e = errors[-1]
        label = f"{status} stream-error {e.get('code')}"
        if not isinstance(e.get("message"), str) or not (e.get("code") is None or isinstance(e.get("code"), str)):
            return label, f"error shape: responses error event {str(e)[:200]}"
        if e.get("code") in ("internal_error", "server_error"):
            return f"{status} stream-error server_error", f"server_error in a stream: {str(e)[:300]}"
        if events[-2:] != [e, last] or last["type"] != "response.failed":
            return label, "responses stream: an error event not followed by response.failed"
        return label, None
    return str(status), None


def _judge_stream(status: int, body: bytes) -> tuple[str, str | None]:
    events = [line[5:].strip() for line in body.decode("utf-8", "replace").split("\n") if line.startswith("data:")]
    if not events:
        return str(status), "a stream without events"
    try:
        first = json.loads(events[0])
    except ValueError:
        first = None
    if isinstance(first, dict) and str(first.get("type", "")).startswith("response."):
        try:
            return _judge_responses_stream(status, [json.loads(e) for e in events])
        except ValueError:
            return str(status), "a stream event that is not JSON"
    for i, data in enumerate(events):
        if data == "[DONE]":
            return str(status), None if i == len(events) - 1 else "events after [DONE]"
        try:
            obj = json.loads(data)
        except ValueError:
            return str(status), f"a stream event that is not JSON: {data[:200]!r}"
        if isinstance(obj, dict) and "error" in obj:
            label = f"{status} stream-error {obj['error'].get('type') if isinstance(obj['error'], dict) else '?'}"
            shape = error_shape_problem(obj)
            if shape:
                return label, shape
            if obj["error"]["type"] == "server_error":
                return label, f"server_error in a stream: {data[:300]}"
            return label, None if i == len(events) - 1 else "events after an error event"
    return str(status), "a stream that ends with neither [DONE] nor an error"


def send(client: httpx.Client, base: str, req: FuzzRequest, bound: float, source: str = "") -> Outcome:
    start = time.monotonic()
    try:
        with client.stream(req.method, base + req.path, content=req.body, headers=req.headers,
                           timeout=bound) as r:
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() - start > bound:
                    return Outcome(req, source, "timeout", time.monotonic() - start,
                                   f"still streaming after {bound:g} s")
            status, problem = judge(r.status_code, r.headers.get("content-type", ""), b"".join(chunks))
    except httpx.TimeoutException:
        return Outcome(req, source, "timeout", time.monotonic() - start, f"no answer within {bound:g} s")
    except httpx.HTTPError as e:
        return Outcome(req, source, "transport-error", time.monotonic() - start, f"{type(e).__name__}: {e}")
    took = time.monotonic() - start
    if problem is None and took > bound:
        problem = f"answered after {took:.1f} s (bound {bound:g} s)"
    return Outcome(req, source, status, took, problem)


def loop_stalls(base: str) -> LoopStalls:
    longest = None
    buckets: dict[float, float] = {}
    steps: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "wafer:event_loop_max_stall_seconds":
                longest = s.value
            elif s.name == "wafer:event_loop_stall_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == "wafer:engine_step_seconds_bucket":
                counts = steps.setdefault(s.labels["kind"], {})
                counts[float(s.labels["le"])] = counts.get(float(s.labels["le"]), 0.0) + s.value
    if longest is None or STALL_LIMIT not in buckets:
        raise RuntimeError("/metrics lacks wafer:event_loop_max_stall_seconds or its histogram's 0.1 s bucket")
    return LoopStalls(longest, buckets, steps)


def health_problem(base: str, model: str, timeout: float = 60.0) -> str | None:
    """None if the server answers /health 200 with nothing left running or waiting (within `timeout`)
    and then answers a plain chat request; else what failed."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(base + "/health", timeout=30)
        h = r.json() if r.status_code == 200 else {}
        if r.status_code == 200 and h.get("running") == 0 and h.get("waiting") == 0:
            break
        if time.monotonic() > deadline:
            return f"/health {r.status_code} {r.text[:300]} after {timeout:g} s"
        time.sleep(0.2)
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]})
    if r.status_code != 200 or not isinstance(r.json()["choices"][0]["message"]["content"], str):
        return f"a plain chat request got {r.status_code}: {r.text[:300]}"
    return None


class _Stop(Exception):
    pass


def run_fuzz(base: str, model: str, requests: int, seed_value: int, concurrency: int = 4,
             bound: float = 30.0, budget_s: float | None = None, progress: bool = False,
             only: list[str] | None = None, failures: Path | None = None, longest: int = 1_000_000) -> Report:
    """Send `requests` generated requests to the server at `base` (which serves `model`), `concurrency`
    at a time, and report; with `budget_s`, stop generating once that many seconds have passed.
    `only`: these generators alone (their shares of `requests`); `failures`: a JSON-lines file that
    gets each failing request whole (base64 body) as it is judged; `longest`: see generators().
    Generation is hypothesis's, its generate phase only: there is no shrinking, since answers are
    judged in other threads after the fact; each failing request is kept whole instead."""
    doc = httpx.get(base + "/openapi.json", timeout=30).json()
    sources = generators(doc, model, longest)
    report = Report(seed=seed_value)
    todo: queue.Queue[tuple[str, FuzzRequest] | None] = queue.Queue(maxsize=2 * concurrency)
    lock = threading.Lock()
    stop = threading.Event()

    def sender() -> None:
        # Connections idle for 2 s are not reused: uvicorn closes them at 5 s, and a request sent on
        # one as it closes fails without the server's fault (httpx's own expiry is also 5 s).
        with httpx.Client(limits=httpx.Limits(keepalive_expiry=2.0)) as client:
            while (item := todo.get()) is not None:
                name, req = item
                earlier = loop_stalls(base) if concurrency == 1 else None
                out = send(client, base, req, bound, name)
                if earlier is not None:  # alone on the server: its stalls are this request's
                    out.stall = loop_stalls(base).longest_since(earlier)[0]
                with lock:
                    report.outcomes.append(out)
                    done = len(report.outcomes)
                if failures is not None and out.problem:
                    with lock, failures.open("a") as f:
                        f.write(json.dumps({"status": out.status, "problem": out.problem, "source": name,
                                            **req.as_json()}) + "\n")
                if progress and out.problem:
                    print(f"  ! {out.status} after {out.seconds:.1f} s: {out.problem[:300]}\n"
                          f"      {out.request.reproduction(300)}", flush=True)
                if progress and done % 500 == 0:
                    print(f"  {done} requests, {report.server_errors} 5xx, {len(report.problems)} problems",
                          flush=True)
                if out.status == "transport-error" and "ConnectError" in (out.problem or ""):
                    stop.set()  # the server is gone: nothing more to learn

    def over_budget() -> bool:
        return stop.is_set() or (budget_s is not None and time.monotonic() - start > budget_s)

    def produce(name: str, examples: int, seed_used: int) -> int:
        """Queue up to `examples` requests of `strategy`; how many it made (fewer when hypothesis ran
        out of distinct ones)."""
        made = 0

        @seed(seed_used)
        @settings(max_examples=examples, phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(sources[name])
        def one(req: FuzzRequest) -> None:
            nonlocal made
            if over_budget():
                raise _Stop
            todo.put((name, req))
            made += 1

        try:
            one()
        except _Stop:
            pass
        return made

    report.before = loop_stalls(base)
    threads = [threading.Thread(target=sender, daemon=True) for _ in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    try:
        # Generator after generator, each to its quota; a generator of few distinct requests is drawn
        # again under other seeds (a few times at most) until it has made its share.
        for name, quota in quotas(requests, only).items():
            made, attempt = 0, 0
            while made < quota and attempt < 5 and not over_budget():
                made += produce(name, quota - made, seed_value + attempt)
                attempt += 1
    finally:
        for _ in threads:
            todo.put(None)
        for t in threads:
            t.join()
    report.seconds = time.monotonic() - start
    report.after = loop_stalls(base)
    report.healthy = health_problem(base, model)
    return report
