"""wafer's tokenizer and chat template against transformers' for the same GGUF."""

from __future__ import annotations

import pytest

from wafer.models.chat_template import ChatTemplate, TemplateError
from wafer.models.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; I'll be there.",
    "中文分词测试：你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 and zwj 👩‍💻",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "    leading spaces\t\ttabs\n\n\n\ntrailing   ",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>mixed<|im_end|> special",
    "Ünïcödé àccents — em dash … ellipsis «quotes»",
    "",
    " ",
    "a" * 300,
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(smollm, hf_tok, text):
    ours = smollm.tokenizer.encode(text)
    assert ours == hf_tok(text).input_ids
    assert smollm.tokenizer.decode(ours, skip_special_tokens=False) == hf_tok.decode(ours)
    assert smollm.tokenizer.decode(ours) == hf_tok.decode(ours, skip_special_tokens=True)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 中文 😀"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(smollm, hf_tok, messages, gen):
    ours = smollm.chat_template.render(messages, add_generation_prompt=gen)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_template_raise_exception_and_bos():
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}",
        bos_token="<s>",
    )
    assert t.render([{"role": "user", "content": "x"}]) == "<s>x"
    with pytest.raises(TemplateError, match="no tools"):
        t.render([{"role": "tool", "content": "x"}])


def test_incremental_detokenizer_never_splits_characters(smollm):
    tok = smollm.tokenizer
    text = "Emoji 😀🎉 and 中文字符 and ü and 👩‍💻 end"
    ids = tok.encode(text)
    # Byte-level BPE splits these characters over several tokens: a naive decoder would show U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
