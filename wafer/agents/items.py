"""The Responses API's request and items, and how a conversation of items becomes chat messages.

Items are kept as the plain dicts the API sends and returns (the `openai` SDK's types describe
them); this module checks what comes in, gives items their ids, and renders a conversation for a
chat model. Items that a program made (tool calls whose `caller` is a program, and their outputs)
are the program's business: the model sees the program and its output only.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from wafer.errors import bad_request

PROGRAM_TOOL = "run_program"  # the function through which a chat model writes a program


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class _Body(BaseModel):
    # As on chat completions: fields we do not know are accepted and ignored (clients send many).
    model_config = ConfigDict(extra="ignore")


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"] | None = None
    summary: str | None = None


class ResponseRequest(_Body):
    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] = True
    max_output_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = None
    store: Annotated[bool, Field(strict=True)] = True
    previous_response_id: str | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI's beta: {"enabled": true, "max_concurrent_subagents": N}; wafer adds "subagent_model" and
    # "max_output_tokens_per_agent"
    multi_agent: dict[str, Any] | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)] | None = None  # wafer's, as on chat


def input_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items with ids, each checked; a string is one user message."""
    if isinstance(raw, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]}]
    return [_item(item, f"input[{i}]") for i, item in enumerate(raw)]


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"Invalid value for '{param}': expected a string.", param)
    return value


def _content(content: Any, role: str, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "output_text" if role == "assistant" else "input_text", "text": content,
                 **({"annotations": []} if role == "assistant" else {})}]
    if not isinstance(content, list):
        raise bad_request(f"Invalid value for '{param}': expected a string or a list of content parts.", param)
    parts = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text"):
            parts.append({**part, "text": _text(part.get("text"), f"{where}.text")})
        elif kind == "refusal":
            parts.append({"type": "refusal", "refusal": _text(part.get("refusal"), f"{where}.refusal")})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"Content parts of type '{kind}' are not supported by this text-only server.",
                              f"{where}.type", "unsupported_content")
        else:
            raise bad_request(f"Invalid value for '{where}.type': {kind!r} is not a content part type.",
                              f"{where}.type")
    return parts


def _id(item: dict[str, Any], prefix: str, param: str) -> str:
    """The item's own id (a string), else a new one: ids are what `item_reference` and
    `input_items?after=` look items up by."""
    given = item.get("id")
    if given is None:
        return new_id(prefix)
    if not isinstance(given, str) or not given:
        raise bad_request(f"Invalid value for '{param}.id': expected a non-empty string.", f"{param}.id")
    return given


def _caller(caller: Any, param: str) -> dict[str, Any] | None:
    """A function call's `caller`, as the API's types have it: absent or null, `{"type": "direct"}`,
    or `{"type": "program", "caller_id": "<the program's call id>"}`."""
    if caller is None:
        return None
    kind = caller.get("type") if isinstance(caller, dict) else None
    if kind == "direct":
        return {"type": "direct"}
    if kind == "program":
        return {"type": "program", "caller_id": _text(caller.get("caller_id"), f"{param}.caller_id")}
    raise bad_request(f"Invalid value for '{param}': expected null, {{\"type\": \"direct\"}} or "
                      "{\"type\": \"program\", \"caller_id\": \"...\"}.", param)


def _item(item: Any, param: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise bad_request(f"Invalid value for '{param}': expected an object.", param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"Invalid value for '{param}.role': {role!r}; expected user, assistant, system or "
                              "developer.", f"{param}.role")
        return {"id": _id(item, "msg", param), "type": "message", "role": role,
                "status": _status(item, param),
                "content": _content(item.get("content"), role, f"{param}.content")}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            _text(item.get(key), f"{param}.{key}")
        out = {**item, "id": _id(item, "fc", param), "status": _status(item, param)}
        caller = _caller(item.get("caller"), f"{param}.caller")
        if caller is None:
            out.pop("caller", None)
        else:
            out["caller"] = caller
        return out
    if kind == "function_call_output":
        _text(item.get("call_id"), f"{param}.call_id")
        output = item.get("output")
        if isinstance(output, list):  # content parts: their text
            output = "".join(_text(p.get("text", "") if isinstance(p, dict) else p, f"{param}.output")
                             for p in output)
        return {**item, "id": _id(item, "fco", param), "output": _text(output, f"{param}.output"),
                "status": _status(item, param)}
    if kind == "program":
        _text(item.get("call_id"), f"{param}.call_id")
        _text(item.get("code"), f"{param}.code")
        return {"fingerprint": "", **item, "id": _id(item, "prog", param)}
    if kind == "program_output":
        _text(item.get("call_id"), f"{param}.call_id")
        _text(item.get("result"), f"{param}.result")
        return {**item, "id": _id(item, "progout", param), "status": _status(item, param)}
    if kind == "reasoning":
        return {"summary": [], **item, "id": _id(item, "rs", param)}
    if kind == "item_reference":
        _text(item.get("id"), f"{param}.id")
        return dict(item)
    raise bad_request(f"Invalid value for '{param}.type': {kind!r} is not an input item type this server "
                      "supports (message, function_call, function_call_output, program, program_output, "
                      "reasoning, item_reference).", f"{param}.type")


def _status(item: dict[str, Any], param: str) -> str:
    status = item.get("status")
    if status is None:
        return "completed"
    if status not in ("in_progress", "completed", "incomplete"):
        raise bad_request(f"Invalid value for '{param}.status': expected in_progress, completed or incomplete.",
                          f"{param}.status")
    return status


def _plain(content: list[dict[str, Any]]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in content)


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: tool calls of one assistant turn in one message, program
    items as calls of `PROGRAM_TOOL`, and what programs did inside left out."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    by_program = {i["call_id"] for i in items
                  if i["type"] == "function_call" and (i.get("caller") or {}).get("type") == "program"}
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _plain(item["content"])})
        elif kind in ("function_call", "program"):
            if kind == "function_call" and item["call_id"] in by_program:
                continue
            call = {"id": item["call_id"], "type": "function", "function": (
                {"name": item["name"], "arguments": item["arguments"]} if kind == "function_call"
                else {"name": PROGRAM_TOOL, "arguments": json.dumps({"code": item["code"]})})}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in by_program:
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "program_output":
            text = item["result"]
            if item.get("status") == "incomplete":
                text = f"The program did not complete.\n{item.get('error') or ''}\nOutput so far:\n{text}"
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages
