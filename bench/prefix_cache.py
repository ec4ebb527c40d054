"""Prefix caching through the server: a 20-turn chat replayed against `wafer serve` with the cache
and again with `--no-prefix-caching`, side by side. Then a burst of prompts with one system prompt
(see `burst`).

Each turn sends the whole history plus a new question (streamed, greedy, up to 48 new tokens) with
the official `openai` client, and keeps the model's answer in the history, as a chat application
does. Printed per turn: prompt tokens, TTFT with and without the cache, `cached_tokens`, and what the
previous turn left in the cache (its prompt and completion, less the last token, which is never fed
back), which `cached_tokens` should equal from turn 2 on, unless the previous answer's text encodes
to other tokens than the model generated (then the cache serves the prompt up to where they part).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table  # noqa: E402

QUESTIONS = [
    "Hi! I am planning a trip to Japan. Where should I start?", "What is the best season to go?",
    "How many days do I need for Tokyo?", "What food should I try there?", "Is sushi expensive?",
    "How do trains work in Japan?", "Should I buy a rail pass?", "What about Kyoto?",
    "Which temples are worth seeing?", "How do I get from Kyoto to Osaka?", "What is Osaka famous for?",
    "Any tips for staying in a ryokan?", "What should I pack?", "Do I need cash or are cards fine?",
    "How do I say thank you in Japanese?", "Is tipping expected?", "What souvenirs are popular?",
    "Can you suggest a day trip from Tokyo?", "How do I stay safe while travelling?",
    "Thanks! Can you summarise the plan in three sentences?",
]


@dataclass
class Turn:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float
    text: str


def replay(base_url: str, model: str, turns: int, max_tokens: int = 48) -> list[Turn]:
    """Play the chat; returns what each turn measured."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="bench", max_retries=0)
    history: list[dict[str, str]] = []
    out = []
    for question in (QUESTIONS * (turns // len(QUESTIONS) + 1))[:turns]:
        history.append({"role": "user", "content": question})
        start = time.perf_counter()
        first = None
        text = []
        usage = None
        for chunk in client.chat.completions.create(model=model, messages=history, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and first is not None
        details = usage.prompt_tokens_details
        out.append(Turn(usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else 0,
                        first - start, "".join(text)))
        history.append({"role": "assistant", "content": out[-1].text})
    return out


def expected_cached(turns: list[Turn]) -> list[int | None]:
    """What each turn should find cached: the whole blocks of what the previous turn computed (the
    cache shares blocks of BLOCK tokens)."""
    from wafer.engine.kv_layout import BLOCK

    return [None] + [(t.prompt_tokens + t.completion_tokens - 1) // BLOCK * BLOCK for t in turns[:-1]]


def serve(port: int, extra: list[str]) -> subprocess.Popen:
    import httpx

    cmd = [sys.executable, "-m", "wafer.cli", "serve", "--port", str(port), "--max-running", "4",
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("wafer serve did not come up")


def burst(n: int, rounds: int) -> None:
    """N prompts with one long system prompt, added to the engine at once (in process): the time until
    every one has its first token, with prompts that share blocks being computed in the same step
    waiting one step for them (scheduler.SHARED_BLOCKS_TO_WAIT) against computing them beside it."""
    import statistics

    import wafer.engine.scheduler as scheduler
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model

    loaded = load_model(None, compute="auto")
    tok = loaded.tokenizer
    system = tok.encode("You are a careful assistant who answers in one short sentence and cites sources. " * 30)
    prompts = [system + tok.encode(f" Question {i}: what is {i} plus {i}?") for i in range(n)]
    wait = scheduler.SHARED_BLOCKS_TO_WAIT
    times: dict[str, list[float]] = {"wait for shared blocks": [], "compute them beside": []}
    hits: dict[str, int] = {}
    try:
        for _ in range(rounds):  # interleaved
            for label, blocks in (("wait for shared blocks", wait), ("compute them beside", 1 << 30)):
                scheduler.SHARED_BLOCKS_TO_WAIT = blocks
                engine = LLMEngine(loaded, EngineConfig())
                engine.generate([tok.encode("hi")], SamplingParams(max_tokens=2))
                started = time.perf_counter()
                seqs = [engine.add(p, SamplingParams(max_tokens=1, temperature=0)) for p in prompts]
                while not all(s.finished for s in seqs):
                    engine.step()
                times[label].append(time.perf_counter() - started)
                hits[label] = engine.blocks.prefix_hit_tokens
    finally:
        scheduler.SHARED_BLOCKS_TO_WAIT = wait
    base = statistics.median(times["compute them beside"])
    print(f"\nA burst: {n} prompts of {len(prompts[0])} tokens, {len(system)} of them one system prompt, added at "
          f"once (in process, default model); median of {rounds} interleaved rounds")
    print(table(["policy", "s until every first token", "vs computing beside", "prompt tokens from the cache"],
                [[label, f"{statistics.median(t):.2f}", f"{base / statistics.median(t):.2f}x", str(hits[label])]
                 for label, t in times.items()]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--port", type=int, default=8420)
    ap.add_argument("--burst", type=int, default=8, help="prompts in the burst section (0: leave it out)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from wafer.models.loader import display_name

    model = display_name(None)
    runs = {}
    for label, extra in (("cache", []), ("no cache", ["--no-prefix-caching"])):
        proc = serve(args.port, extra)
        try:
            runs[label] = replay(f"http://127.0.0.1:{args.port}/v1", model, args.turns)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print(f"  replayed with {label}", file=sys.stderr)
    cached, plain = runs["cache"], runs["no cache"]
    want = expected_cached(cached)
    rows = []
    for i, (a, b, w) in enumerate(zip(cached, plain, want), 1):
        rows.append([str(i), str(a.prompt_tokens), f"{b.ttft * 1000:.0f}", f"{a.ttft * 1000:.0f}",
                     str(b.cached_tokens), str(a.cached_tokens), "-" if w is None else str(w),
                     "-" if w is None else ("yes" if a.cached_tokens == w else
                                            "retokenized" if a.cached_tokens < w else "NO")])
    print(f"{args.turns}-turn chat replayed through wafer serve (default model, streamed, greedy, up to 48 new tokens "
          f"per turn), with and without the prefix cache")
    print(table(["turn", "prompt tokens", "TTFT no cache ms", "TTFT cache ms", "cached (no cache)", "cached (cache)",
                 "previous turn's KV", "equal"], rows))
    print("(retokenized: the previous answer's text encodes to other tokens than the model generated, e.g. one "
          "word split in two; the cache serves the prompt up to where they part, as vLLM's does)")
    late = cached[1:]
    print(f"turns 2-{args.turns}: TTFT with cache {min(t.ttft for t in late) * 1000:.0f}-"
          f"{max(t.ttft for t in late) * 1000:.0f} ms; without {min(t.ttft for t in plain[1:]) * 1000:.0f}-"
          f"{max(t.ttft for t in plain[1:]) * 1000:.0f} ms; last turn {plain[-1].ttft / cached[-1].ttft:.1f}x faster "
          f"with the cache")
    same = all(a.text == b.text for a, b in zip(cached, plain))
    print(f"same answers with and without the cache: {'yes' if same else 'NO'}")
    if args.burst:
        burst(args.burst, 3)


if __name__ == "__main__":
    main()
