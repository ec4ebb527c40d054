"""Tokenizers (from a GGUF's vocabulary or a tokenizer.json) and streaming detokenisation."""

from __future__ import annotations

import json
import re
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from wafer.models.gguf_loader import GGUFTokenizerData

# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4

# How each `tokenizer.ggml.pre` splits text before BPE, as llama.cpp does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _merges_from_scores(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """Sentencepiece GGUFs carry scores, not merges: every split of a token into two vocab
    entries is a merge, ranked by the merged token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = scores if scores else [-i for i in range(len(tokens))]
    found: list[tuple[float, int, int, tuple[str, str]]] = []
    for tok, idx in vocab.items():
        for cut in range(1, len(tok)):
            a, b = tok[:cut], tok[cut:]
            if a in vocab and b in vocab:
                found.append((-rank[idx], vocab[a], vocab[b], (a, b)))
    found.sort()
    return [m for *_, m in found]


def tokenizer_from_gguf(data: GGUFTokenizerData, scores: list[float] | None = None) -> Tokenizer:
    if data.model == "gpt2":
        alphabet = _byte_alphabet()
        spelled = set(alphabet.values())
        if set("".join(data.tokens)) <= spelled:  # the usual case, checked at once: 0.1 s for 150k tokens one by one
            vocab = {t: i for i, t in reversed(list(enumerate(data.tokens)))}  # the first of duplicates wins
        else:
            vocab = {}
            for i, t in enumerate(data.tokens):
                key = t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))
                vocab.setdefault(key, i)
        merges = [tuple(m.split(" ", 1)) for m in data.merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        split = _SPLITS.get(data.pre or "")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
        if split is not None:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
        elif data.pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
    elif data.model == "llama":
        vocab = {t: i for i, t in enumerate(data.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in data.merges] or _merges_from_scores(data.tokens, scores)
        unk = next((t for t in data.tokens if t == "<unk>"), None)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token=unk))
        # Gemma's sentencepiece adds no space before the text (tokenizer.ggml.add_space_prefix false).
        prefix = [normalizers.Prepend("▁")] if data.add_space_prefix else []
        tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if data.add_space_prefix else []
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    else:
        raise ValueError(f"tokenizer model {data.model!r} is not supported")
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(data.tokens, data.token_types)
        if ty == _CONTROL
    ]
    tok.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(data.tokens, data.token_types) if ty == _USER_DEFINED]
    if user:
        tok.add_tokens(user)
    if data.add_bos and data.bos_id is not None:
        bos = data.tokens[data.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, data.bos_id)]
        )
    return tok


class TextTokenizer:
    """What the engine and server need of a tokenizer: ids, text, special tokens, template source."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos_ids = [tokenizer.token_to_id(eos_token)] if eos_token else []
        self.eos_ids: list[int] = [i for i in eos_ids + list(extra_eos_ids or []) if i is not None]
        # Byte-level vocabularies spell bytes with printable characters; invert that for `bytes`.
        self._byte_of = {c: b for b, c in _byte_alphabet().items()} if tokenizer.token_to_id("Ġ") is not None else None
        self._special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (byte-level vocabularies spell a byte a
        character, so a token's entry is never shorter than its text)."""
        return max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 4096:  # the batch call releases the GIL while it works; the single one holds it
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.tokenizer.id_to_token(i) or ""

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes a token stands for (for logprobs): may be part of a UTF-8 character."""
        s = self.tokenizer.id_to_token(i) or ""
        if s in self._special:
            return s.encode("utf-8")
        if self._byte_of is not None and all(c in self._byte_of for c in s):
            return bytes(self._byte_of[c] for c in s)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", s):
            return bytes([int(s[3:5], 16)])
        return s.replace("▁", " ").encode("utf-8")

    @classmethod
    def from_gguf(cls, data: GGUFTokenizerData, scores: list[float] | None = None) -> "TextTokenizer":
        tok = tokenizer_from_gguf(data, scores)
        name = lambda i: data.tokens[i] if i is not None and 0 <= i < len(data.tokens) else None  # noqa: E731
        return cls(tok, name(data.bos_id), name(data.eos_id), data.chat_template, data.extra_eos_ids)

    @classmethod
    def from_dir(cls, path: Path) -> "TextTokenizer":
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def content(v: object) -> str | None:
            return v.get("content") if isinstance(v, dict) else v  # type: ignore[return-value]

        template = cfg.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        extra: list[int] = []
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        return cls(tok, content(cfg.get("bos_token")), content(cfg.get("eos_token")), template, extra)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a multi-byte character.

    Decoding a short window of ids (the last emitted few plus the new ones) and diffing against
    the window without the new ones keeps the cost per token constant and lets tokenizers that
    need context (leading-space handling) see it.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        text = decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character comes out as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""
