"""Interactive time to first token while a batch runs, against an idle server's, side by side.

`wafer serve` (luna by default) with a store of its own. In each round, first on the idle server,
interactive chat requests one after another (streamed, greedy, a few tokens each, a pause between
them); then a batch of many lines is created (Batch API, the official SDK) and, once it runs, as
many interactive requests again, with other questions of the same length (so that neither phase
gets the other's prompts from the prefix cache); the batch is then cancelled and the server left to
go idle. Rounds alternate the two phases, so that a machine whose load drifts weighs on both alike.
Printed: TTFT's median, mean and 90th percentile in each phase and their ratios, and how many batch
lines finished meanwhile (the batch did run). The Batch API's target: the ratio within 1.2.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import now, table  # noqa: E402
from bench.served import start  # noqa: E402

TARGET = 1.2


def wait_idle(base: str) -> None:
    """Until the server runs and queues nothing (a cancelled batch's lines are gone)."""
    import httpx

    while True:
        health = httpx.get(base + "/health", timeout=10).json()
        if health["running"] == 0 and health["waiting"] == 0:
            return
        time.sleep(0.2)


def ttft(client, model: str, question: str, max_tokens: int) -> float:
    """Seconds from sending a streamed chat request to its first content."""
    start = now()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = now() - start
    return first if first is not None else now() - start


def phase(client, model: str, offset: int, n: int, pause: float, max_tokens: int) -> list[float]:
    out = []
    for i in range(n):
        k = offset + i
        out.append(ttft(client, model, f"Question {k}: name a colour and a fruit, numbered {k}.", max_tokens))
        time.sleep(pause)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="luna", help="what `wafer serve` serves (a path, or a model or tier)")
    ap.add_argument("--requests", type=int, default=20, help="interactive requests in each phase of a round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of an idle phase and a busy one")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds between interactive requests")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens of each interactive answer")
    ap.add_argument("--lines", type=int, default=2000, help="lines of the batch (enough to outlast the phase)")
    ap.add_argument("--line-tokens", type=int, default=32, help="tokens of each batch line's answer")
    ap.add_argument("--max-running", type=int, default=16, help="the server's --max-running")
    args = ap.parse_args()

    from openai import OpenAI

    with tempfile.TemporaryDirectory() as tmp:
        server = start([args.model, "--state-db", str(Path(tmp) / "state.db"), "--max-running", str(args.max_running)],
                       Path(tmp) / "server.log")
        try:
            client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
            model = client.models.list().data[0].id
            phase(client, model, 100_000, 3, 0.0, args.max_tokens)  # warm-up: the system prompt cached, paths run
            lines = "".join(json.dumps({
                "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model, "max_tokens": args.line_tokens, "temperature": 0, "ignore_eos": True,
                         "messages": [{"role": "user", "content": f"Line {i}: write about the number {i}."}]},
            }) + "\n" for i in range(args.lines))
            f = client.files.create(file=("bench.jsonl", io.BytesIO(lines.encode())), purpose="batch")
            idle: list[float] = []
            busy: list[float] = []
            done, seconds = 0, 0.0
            for r in range(args.rounds):
                wait_idle(server.root)
                idle += phase(client, model, 2 * r * 1_000, args.requests, args.pause, args.max_tokens)
                batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")
                while client.batches.retrieve(batch.id).request_counts.completed < 1:  # running, lines decoding
                    time.sleep(0.2)
                before = client.batches.retrieve(batch.id).request_counts.completed
                started = now()
                busy += phase(client, model, (2 * r + 1) * 1_000, args.requests, args.pause, args.max_tokens)
                seconds += now() - started
                done += client.batches.retrieve(batch.id).request_counts.completed - before
                client.batches.cancel(batch.id)
                while client.batches.retrieve(batch.id).status != "cancelled":
                    time.sleep(0.2)
        finally:
            server.stop()

    def ms(x: float) -> str:
        return f"{x * 1000:.0f} ms"

    rows = []
    for name, fn in (("median", statistics.median), ("mean", statistics.fmean),
                     ("p90", lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))])):
        a, b = fn(idle), fn(busy)
        rows.append([name, ms(a), ms(b), f"{b / a:.2f}x"])
    print(f"Interactive TTFT on `wafer serve {args.model}` (--max-running {args.max_running}): {args.rounds} rounds of "
          f"{args.requests} streamed chat requests, {args.max_tokens} tokens each, {args.pause:g} s apart, idle and "
          f"then during a batch of {args.lines} lines of {args.line_tokens} tokens")
    print(table(["TTFT", "idle server", "during the batch", "ratio"], rows))
    print(f"batch lines finished during the busy phases: {done} in {seconds:.1f} s "
          f"({done * args.line_tokens / seconds:.0f} batch tokens/s beside the interactive requests)")
    ratio = statistics.median(busy) / statistics.median(idle)
    print(f"median ratio {ratio:.2f}x: {'within' if ratio <= TARGET else 'over'} the target of {TARGET}x")


if __name__ == "__main__":
    main()
