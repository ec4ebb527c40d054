"""The requests of the storm and the soak: chat completions, streamed or not, read to the end or cut by the
client at a chosen point, each reduced to an Outcome a table can count."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import aiohttp

from wafer.benchmark.workload import Prompt, synthetic

INPUT_LENS = (16, 64, 256)  # prompt tokens of the mix (small: the storm and soak must end on a shared 2-core machine)


@dataclass
class Cut:
    """Where the client closes the connection: after `chunks` content chunks of a stream, or `seconds` after
    sending (before the head, while queued or prefilling, or mid-answer). None of both: read to the end."""

    chunks: int | None = None
    seconds: float | None = None

    @property
    def planned(self) -> bool:
        return self.chunks is not None or self.seconds is not None


@dataclass
class Outcome:
    stream: bool
    status: int  # 0: no response head came before the cut or the failure
    cut: bool = False  # closed by the client as planned, before the answer's end
    error: str | None = None  # anything else that went wrong (a connection error, an error event, a bad body)
    retry_after: str | None = None
    tokens: int = 0  # content chunks read (streamed) or completion tokens (not)

    @property
    def label(self) -> str:
        """The row this outcome counts in."""
        if self.cut:
            return f"cut ({'stream' if self.stream else 'plain'}) after {'head' if self.status else 'no head'}"
        if self.error:
            return f"{self.status or 'no status'} error: {self.error[:60]}"
        if self.status == 429:
            return "429 with Retry-After" if self.retry_after else "429 WITHOUT Retry-After"
        return str(self.status)


def prompt_pool(per_len: int, seed: int) -> list[Prompt]:
    """Prompts of every length of INPUT_LENS (tokens by the bundled tokenizer), made once: exact lengths take
    seconds of tokenizing for the longest."""
    from wafer.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    return [p for i, n in enumerate(INPUT_LENS) for p in synthetic(tok, per_len, n, 0, seed + i)]


def openai_error_shape(raw: bytes) -> bool:
    try:
        err = json.loads(raw)["error"]
        return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()
    except (ValueError, KeyError, TypeError):
        return False


async def _send(session: aiohttp.ClientSession, url: str, body: dict, cut: Cut, out: Outcome) -> None:
    async with session.post(url, json=body) as r:
        out.status = r.status
        out.retry_after = r.headers.get("Retry-After")
        if r.status != 200:
            raw = await r.read()
            if not openai_error_shape(raw):
                out.error = f"error body not OpenAI-shaped: {raw[:80]!r}"
            return
        if not body["stream"]:
            answer = await r.json()
            out.tokens = answer["usage"]["completion_tokens"]
            if not answer["choices"] or answer["choices"][0]["finish_reason"] not in ("stop", "length"):
                out.error = f"finish_reason {answer['choices'][0]['finish_reason'] if answer['choices'] else None}"
            return
        pending = b""
        async for data in r.content.iter_any():
            pending = (pending + data).replace(b"\r\n", b"\n")
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    obj = json.loads(line[5:])
                    if "error" in obj:
                        out.error = f"error event: {obj['error'].get('type')}"
                        return
                    if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                        out.tokens += 1
                        if cut.chunks is not None and out.tokens >= cut.chunks:
                            out.cut = True
                            r.close()  # drops the connection: what a client that stops reading does
                            return
                    fin = [c.get("finish_reason") for c in obj.get("choices") or [] if c.get("finish_reason")]
                    if fin and fin[0] not in ("stop", "length"):
                        out.error = f"finish_reason {fin[0]}"


async def chat(session: aiohttp.ClientSession, base_url: str, model: str, prompt: Prompt, max_tokens: int,
               stream: bool, cut: Cut = Cut(), marker: str = "") -> Outcome:
    """One chat completion at temperature 1, run to `max_tokens` (EOS ignored), unless cut. `marker` starts the
    prompt so that no prefix cache serves one request from another."""
    body = {"model": model, "messages": [{"role": "user", "content": marker + prompt.text}], "max_tokens": max_tokens,
            "stream": stream, "temperature": 1.0, "ignore_eos": True}
    out = Outcome(stream, 0)
    try:
        if cut.seconds is None:
            await _send(session, base_url.rstrip("/") + "/chat/completions", body, cut, out)
        else:
            await asyncio.wait_for(_send(session, base_url.rstrip("/") + "/chat/completions", body, cut, out),
                                   cut.seconds)
    except asyncio.TimeoutError:
        if cut.seconds is not None and not out.error:
            out.cut = True  # wait_for cancelled the request: aiohttp closes a connection it had not read to the end
        else:
            out.error = "timeout"
    except (aiohttp.ClientError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def random_cut(rng: random.Random, stream: bool, max_tokens: int) -> Cut:
    """A cut at a random point: a third before the first token can come (queued or prefilling), the rest
    after a random number of tokens (streamed) or a random time (not streamed, where no token shows)."""
    if rng.random() < 1 / 3:
        return Cut(seconds=rng.uniform(0.0, 0.3))
    if stream:
        return Cut(chunks=rng.randint(1, max_tokens - 1))
    return Cut(seconds=rng.uniform(0.3, 4.0))


def session(limit: int) -> aiohttp.ClientSession:
    """A connection per request, closed at its end: a cut request's connection must not be reused."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=900))


def counts(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.label for o in outcomes)


async def warm_up(base_url: str, model: str, pool: list[Prompt], max_running: int, max_tokens: int,
                  concurrency: int, rng: random.Random) -> list[Outcome]:
    """The mix read to the end: first `max_running` of the longest prompts to `max_tokens` at once, so every KV
    slot is written as far as any later request can write it (the cache's pages are taken on first write and
    kept), then half as many of every length, streamed and not. Resident memory after this is the baseline."""
    longest = [p for p in pool if p.input_len == max(INPUT_LENS)]
    jobs = [(longest[i % len(longest)], max_tokens, i % 2 == 0) for i in range(max_running)]
    jobs += [(pool[i % len(pool)], rng.randint(16, max_tokens), i % 2 == 1) for i in range(max_running // 2)]
    sem = asyncio.Semaphore(concurrency)
    async with session(concurrency) as s:

        async def one(i: int, p: Prompt, n: int, stream: bool) -> Outcome:
            async with sem:
                return await chat(s, base_url, model, p, n, stream, marker=f"[warm {i}] ")

        return list(await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs))))
