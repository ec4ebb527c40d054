"""What to send: synthetic prompts of exact token lengths, or prompts from a JSONL file."""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from pathlib import Path

from wafer.models.tokenizer import TextTokenizer

# Plain English words: each is one token in common BPE vocabularies, and they re-tokenise stably.
_WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one you were "
    "all her she there would their we him been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three"
).split()


@dataclass
class Prompt:
    text: str
    input_len: int | None  # tokens of `text` by the client tokenizer, when known
    output_len: int


def synthetic(tokenizer: TextTokenizer, n: int, input_len: int, output_len: int, seed: int,
              shared_prefix: int = 0) -> list[Prompt]:
    """n prompts of exactly input_len tokens. Each starts with a unique marker, so that a prefix
    cache cannot serve one request from another, unless shared_prefix asks for that many
    identical leading tokens."""
    rng = random.Random(seed)
    run = uuid.UUID(int=rng.getrandbits(128)).hex[:8]
    shared = _words_to_length(tokenizer, rng, shared_prefix, "") if shared_prefix else ""
    prompts = []
    for i in range(n):
        marker = f"{shared}[{run}-{i}] " if not shared_prefix else f"{shared} [{run}-{i}] "
        text = _words_to_length(tokenizer, rng, input_len, marker)
        prompts.append(Prompt(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    return prompts


def _words_to_length(tokenizer: TextTokenizer, rng: random.Random, target: int, start: str) -> str:
    def count(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=False))

    text = start.rstrip()
    while count(text) < target:
        text += " " + rng.choice(_WORDS)
    while count(text) > target and " " in text:
        text = text.rsplit(" ", 1)[0]
    while count(text) < target:  # top up one character-token at a time
        text += "."
    return text


def from_jsonl(path: Path, n: int, default_output_len: int, tokenizer: TextTokenizer | None) -> list[Prompt]:
    """Lines with "prompt" (or "messages" whose last user message is taken) and optionally
    "output_len" / "max_tokens"."""
    prompts = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("prompt")
            if text is None and row.get("messages"):
                text = next(m["content"] for m in reversed(row["messages"]) if m.get("role") == "user")
            if not isinstance(text, str):
                raise ValueError(f"{path}: each line needs a 'prompt' string or 'messages'")
            out = int(row.get("output_len") or row.get("max_tokens") or default_output_len)
            n_in = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else None
            prompts.append(Prompt(text, n_in, out))
            if len(prompts) >= n:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    base = list(prompts)
    while len(prompts) < n:  # cycle to the requested count
        prompts.append(base[len(prompts) % len(base)])
    return prompts
