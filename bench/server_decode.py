"""Single-stream decode through the server vs in the engine, side by side in one run.

The same chat prompt, greedy, EOS ignored, 256 new tokens: with the engine in this process, and
through `wafer serve` (a subprocess on loopback), streamed, with three clients: `wafer bench`'s
(aiohttp on uvloop), the official `openai` SDK, and the standard library's blocking http.client.

A baseline server: bench/minimal_server.py, the same engine stepped on an event loop that writes each
token's event straight to the socket and does nothing else, read by http.client. What it loses against
the engine is what streaming over loopback costs on this machine, not what wafer's HTTP layer costs.

The clients run on this same 2-core machine, where the engine's two threads fill both cores, so a
client's own work on each chunk is taken from the engine's cores (the last column prints each
client process's CPU per token). In a deployment the client is elsewhere. So each client runs twice, in a process of its own:
once at the engine's priority, and once at nice 19, where it reads in the engine's idle moments.
The server's own threads keep their priority in both, so everything the server does per token is
counted either way.

Two rates per row, each the median of 9 rounds. In a round every client runs once, each run between
two runs of the engine, and its ratio is to the mean of those two: this shared machine's speed drifts
from one second to the next, so a run is compared with the engine's runs on either side of it. Each
measured run comes just after a short request of the same client (or the engine): a process idle for
seconds here starts its next request tens of milliseconds late, and the target is the speed of a
server in use.
- request tok/s: tokens over the whole request, from sending it to reading the last byte. A client
  that reads late is charged for it, so this is the ratio the target is judged on;
- decode tok/s: the tokens after the first over the time after the first (bench/decode.py's measure).
The last column is the 99th percentile of the gaps between tokens as the client read them: a niced
client reads in bursts, which shows there and not in the request rate.
"""

from __future__ import annotations

import argparse
import atexit
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import PROMPT, now, table  # noqa: E402
from bench.decode import THREADS  # noqa: E402
from bench.prefix_cache import serve  # noqa: E402


@dataclass
class Timeline:
    """When a request was sent, when each token arrived, when it ended, and how many tokens it made."""

    start: float
    arrivals: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    cpu: float | None = None  # the client process's CPU seconds for the request (None: the engine row)

    def request_rate(self) -> float:
        return self.tokens / (self.end - self.start)

    def decode_rate(self) -> float:
        return (self.tokens - 1) / (self.end - self.arrivals[0])

    def gap_p99_ms(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.arrivals, self.arrivals[1:]))
        return 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


# A client is made once per client process and reused for every request, as an application and
# `wafer bench` do: making one per request cost the client process milliseconds of CPU (an event
# loop, a session, the SDK's client) while the server was prefilling. Connections are not kept
# alive: a client's runs are seconds apart, past the server's keep-alive timeout, and reusing a
# connection the server is closing fails the request.
@cache
def _sdk(base_url: str):  # type: ignore[no-untyped-def]
    import httpx
    from openai import OpenAI

    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=300)
    return OpenAI(base_url=base_url, api_key="bench", max_retries=0, http_client=http)


@cache
def _aiohttp():  # type: ignore[no-untyped-def]
    """An event loop of the client process's own (`wafer bench`'s kind) and a session on it."""
    import aiohttp

    from wafer.benchmark.runner import new_event_loop

    loop = new_event_loop()

    async def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    client = loop.run_until_complete(session())
    atexit.register(lambda: loop.run_until_complete(client.close()))
    return loop, client


def through_sdk(base_url: str, model: str, n: int) -> Timeline:
    client = _sdk(base_url)
    t = Timeline(now())
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            t.arrivals.append(now())
        if chunk.usage is not None:
            t.tokens = chunk.usage.completion_tokens
    t.end = now()
    return t


def through_bench_client(base_url: str, model: str, n: int) -> Timeline:
    """The same request with `wafer bench`'s client (aiohttp, the JSON parsed after the stream)."""
    from wafer.benchmark.client import send
    from wafer.benchmark.workload import Prompt

    loop, session = _aiohttp()
    rec = loop.run_until_complete(send(session, base_url, "chat", model, Prompt(PROMPT, None, n), None, True, 300.0))
    return Timeline(rec.start, rec.chunk_times, rec.end, rec.usage_completion)  # type: ignore[arg-type]


def through_stdlib(base_url: str, model: str, n: int) -> Timeline:
    """The same request with the standard library's blocking http.client: the least client CPU per
    token, so this row shows the server's own cost."""
    import http.client
    import json
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True})
    conn = http.client.HTTPConnection(u.hostname, u.port)
    t = Timeline(now())
    conn.request("POST", u.path + "/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r, buf = conn.getresponse(), b""
    while data := r.read1(65536):
        buf += data
        *events, buf = buf.split(b"\n\n")
        for e in events:
            if not e.startswith(b"data: ") or e == b"data: [DONE]":
                continue
            obj = json.loads(e[6:])
            if obj["choices"] and obj["choices"][0]["delta"].get("content"):
                t.arrivals.append(now())
            if obj.get("usage"):
                t.tokens = obj["usage"]["completion_tokens"]
    t.end = now()
    conn.close()
    return t


def engine_runner(compute: str, loaded=None):  # type: ignore[no-untyped-def]
    """The engine in this process (on `loaded`, else the default model loaded for `compute`), with
    the server's settings for this request: no prefix cache (each run prefills its whole prompt),
    ignore_eos, the time of each token as its step returns."""
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model

    loaded = loaded or load_model(compute=compute)
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=2048, prefix_caching=False))
    ids = loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": PROMPT}]),
                                  add_special_tokens=False)

    def run(n: int) -> Timeline:
        t = Timeline(now())
        seq = engine.add(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        with torch.inference_mode():
            while not seq.finished:
                engine.step()
                while len(t.arrivals) < len(seq.output_ids):
                    t.arrivals.append(now())
        t.end, t.tokens = now(), len(seq.output_ids)
        return t

    return run


ENGINE = "engine, in process"
MINIMAL = "minimal server"  # bench/minimal_server.py
CLIENTS = {"wafer bench's client": through_bench_client, "openai SDK": through_sdk, "http.client": through_stdlib}


def with_cpu(fn: Callable[[str, str, int], Timeline], base_url: str, model: str, n: int) -> Timeline:
    """`fn`'s request, with the CPU time its process spent on it (run in the client's own process)."""
    start = time.process_time()
    t = fn(base_url, model, n)
    t.cpu = time.process_time() - start
    return t


def minimal_server(port: int, quant: str) -> subprocess.Popen:
    """bench/minimal_server.py on `port`, once it is ready."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("minimal_server.py")), "--port", str(port),
                             "--quant", quant], stdout=subprocess.PIPE)
    if proc.stdout is None or proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise RuntimeError("bench/minimal_server.py did not come up")
    return proc


def main() -> None:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--port", type=int, default=8431)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    from wafer.models.loader import display_name

    # No prefix cache, as in the engine row: every request prefills its whole prompt.
    proc = serve(args.port, ["--quant", args.quant, "--max-running", "1", "--no-prefix-caching"])
    minimal: subprocess.Popen | None = None
    pools = {nice: ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=os.nice, initargs=(nice,))
             for nice in (0, 19)}
    try:
        minimal = minimal_server(args.port + 1, args.quant)
        url, name = f"http://127.0.0.1:{args.port}/v1", display_name(None)
        minimal_url = f"http://127.0.0.1:{args.port + 1}/v1"
        torch.set_num_threads(THREADS)
        engine = engine_runner(args.quant)
        clients: dict[str, Callable[[int], Timeline]] = {}
        for nice, pool in pools.items():
            for client, fn in CLIENTS.items():
                clients[f"wafer serve + {client}, client at nice {nice}"] = (
                    lambda n, fn=fn, pool=pool: pool.submit(with_cpu, fn, url, name, n).result())
            clients[f"{MINIMAL} + http.client, client at nice {nice}"] = (
                lambda n, pool=pool: pool.submit(with_cpu, through_stdlib, minimal_url, name, n).result())
        def measure(run: Callable[[int], Timeline]) -> Timeline:
            # A short request first, from the same client: a process idle for seconds on this VM
            # starts its next request slowly (tens of ms more to the first token, for the engine and
            # the server alike), and the target is the speed of a server in use, not of its wake-up.
            run(8)
            return run(args.tokens)

        for run in [engine, *clients.values()]:
            run(16)  # warm-up
        rows: dict[str, list[Timeline]] = {ENGINE: [], **{k: [] for k in clients}}
        # Each client run's engine runs, just before and just after it.
        around: dict[str, list[tuple[Timeline, Timeline]]] = {k: [] for k in clients}
        for _ in range(args.repeats):
            before = measure(engine)
            rows[ENGINE].append(before)
            for key, run in clients.items():
                rows[key].append(measure(run))
                after = measure(engine)
                rows[ENGINE].append(after)
                around[key].append((before, after))
                before = after
    finally:
        for pool in pools.values():
            pool.shutdown()
        for p in (proc, minimal):
            if p is None:
                continue
            p.terminate()
            p.wait(timeout=60)
    for key, timelines in rows.items():
        if any(t.tokens != args.tokens for t in timelines):
            raise SystemExit(f"{key}: a request returned {[t.tokens for t in timelines]} tokens, not {args.tokens}")

    def paired(key: str, rate: Callable[[Timeline], float]) -> str:
        """The median of this row's runs' rates over the mean rate of the engine runs on either side,
        with their range."""
        if key == ENGINE:
            return "1.00x (1.00-1.00)"
        r = sorted(rate(t) / ((rate(a) + rate(b)) / 2) for t, (a, b) in zip(rows[key], around[key]))
        return f"{statistics.median(r):.2f}x ({r[0]:.2f}-{r[-1]:.2f})"

    print(f"Single-stream decode, default model ({args.quant}), {args.tokens} new tokens, greedy, EOS ignored, "
          f"{THREADS} threads, {args.repeats} rounds; rates are medians, ratios the median (and range) of each "
          f"run's ratio to the mean of the engine runs just before and after it")
    def client_cpu(v: list[Timeline]) -> str:
        return "-" if v[0].cpu is None else f"{1000 * statistics.median(t.cpu / t.tokens for t in v):.3f}"  # type: ignore[operator]

    print(table(["where", "request tok/s", "vs engine", "decode tok/s", "vs engine", "token gap p99 ms",
                 "client CPU ms/token"],
                [[k, f"{statistics.median(t.request_rate() for t in v):.1f}", paired(k, Timeline.request_rate),
                  f"{statistics.median(t.decode_rate() for t in v):.1f}", paired(k, Timeline.decode_rate),
                  f"{statistics.median(t.gap_p99_ms() for t in v):.1f}", client_cpu(v)] for k, v in rows.items()]))


if __name__ == "__main__":
    main()
