"""The prompt a chat request with tool calls and results becomes is the one transformers'
`apply_chat_template` renders from the model's own template (Qwen2.5-Coder's, read from its GGUF),
given the calls' arguments as objects, as vLLM passes them: the server's path from request body to
prompt text (messages, tools, rendering), with transformers' Jinja as the independent reference."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from wafer.models import catalog

TOOLS = [{"type": "function", "function": {
    "name": "get_stock", "description": "How many units of a product are in stock.",
    "parameters": {"properties": {"sku": {"title": "Sku", "type": "string"}}, "required": ["sku"],
                   "title": "get_stock_args", "type": "object", "additionalProperties": False},
    "strict": True}}]
ASKED = [{"role": "system", "content": "You answer questions about stock levels."},
         {"role": "user", "content": "How many units of product A7 are in stock?"}]


def call(i: int, arguments: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "get_stock", "arguments": arguments}}


def result(i: int, text: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": text}


# The OpenAI Agents SDK's second turn, as it sent it to terra (issue 52).
ONE = [*ASKED, {"role": "assistant", "content": None, "tool_calls": [call(1, '{"sku": "A7"}')]},
       result(1, "4217 units of A7 are in stock.")]
# Two calls in one reply and their two results; text before a call; arguments with nesting and non-ASCII.
TWO = [*ASKED,
       {"role": "assistant", "content": None, "tool_calls": [call(1, '{"sku": "A7"}'), call(2, '{"sku": "B8"}')]},
       result(1, "4217 units"), result(2, "12 units"),
       {"role": "assistant", "content": "A7: 4217, B8: 12."},
       {"role": "user", "content": "And in Zürich?"},
       {"role": "assistant", "content": "Let me look.",
        "tool_calls": [call(3, '{"sku": "A7", "where": {"city": "Zürich", "days": [1, 2]}}')]},
       result(3, '{"units": 9}')]


@pytest.fixture(scope="module")
def qwen():
    """wafer's rendering path for Qwen2.5-Coder-0.5B's template (a stand-in for the served model:
    rendering needs only its template), and transformers' tokenizer over the same template."""
    from transformers import PreTrainedTokenizerFast

    from wafer.models.chat_template import ChatTemplate
    from wafer.models.loader import load_tokenizer

    model = catalog.find("terra")
    if model is None or catalog.installed_path(model) is None:
        pytest.skip("Qwen2.5-Coder-0.5B-Instruct is not installed (`wafer models install`)")
    tok = load_tokenizer("terra")
    served = SimpleNamespace(m=SimpleNamespace(chat_template=ChatTemplate(tok.chat_template, tok.bos_token,
                                                                          tok.eos_token)))
    return served, PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, chat_template=tok.chat_template)


def wafer_prompt(served, body: dict) -> str:
    from wafer.server.chat import ChatHandler
    from wafer.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", **body})
    tools, choice = ChatHandler._tools(served, req)
    return ChatHandler._render(served, ChatHandler._messages(served, req), tools, choice)


def with_objects(messages: list[dict]) -> list[dict]:
    """The calls' arguments parsed, as transformers' documentation and vLLM give them to a template."""
    def parsed(c: dict) -> dict:
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    return [{**m, "tool_calls": [parsed(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


@pytest.mark.parametrize("messages", [ONE, TWO], ids=["one call", "two calls and a second round"])
@pytest.mark.parametrize("choice", ["auto", "required", "none", None], ids=["auto", "required", "none", "no tools"])
def test_a_tool_conversation_renders_as_transformers_renders_it(qwen, messages, choice):
    served, hf = qwen
    body = {"messages": messages, **({"tools": TOOLS, "tool_choice": choice} if choice else {})}
    # tool_choice none: the tools are left out of the prompt (the model is not to call them).
    tools = TOOLS if choice in ("auto", "required") else None
    expected = hf.apply_chat_template(with_objects(messages), tools=tools, add_generation_prompt=True, tokenize=False)
    assert wafer_prompt(served, body) == expected
