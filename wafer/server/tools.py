"""Tool calling and structured output: grammars from JSON Schemas, the prompt format for models
whose template knows no tools, and parsing the model's calls (whole or streamed).

The model writes each call as `<tool_call>{"name":"NAME","arguments":{...}}</tool_call>`; the
grammar makes that exact shape the only one it can produce once it starts a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from llguidance import LLMatcher

from wafer.server.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Compact separators make the generated JSON's layout fixed, which the streaming parser relies on.
_COMPACT = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise bad_request("must be a JSON Schema object", param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise bad_request(f"not a valid JSON Schema: {e.message}", param) from None
    return schema


def _call_schema(name: str, parameters: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call of a tool, and the definitions its arguments refer to. Those sit at the
    root of the arguments' schema (`$defs`, as pydantic writes them, or `definitions`), which is no
    longer the root once nested in the call: they move to the grammar's root under names of this
    tool's own, and the references follow."""
    parameters = parameters or {"type": "object"}
    defs = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    prefix = f"{name}__"

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for base in ("#/$defs/", "#/definitions/"):
                    if value.startswith(base):
                        value = "#/$defs/" + prefix + value[len(base):]
            out[key] = rewrite(value)
        return out

    arguments = rewrite({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})
    schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
              "required": ["name", "arguments"], "additionalProperties": False}
    return schema, {prefix + k: rewrite(v) for k, v in defs.items()}


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool) -> str:
    """Lark grammar for the assistant's reply. `auto`: free text (not starting with '<') or calls;
    `required`: one call or more (one, without parallel calls); a named function: that call."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        choice, parallel = "required", False
    calls = [_call_schema(t["function"]["name"], t["function"].get("parameters") or {}) for t in tools]
    schemas = [schema for schema, _ in calls]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    defs = {k: v for _, d in calls for k, v in d.items()}
    if defs:
        body = {**body, "$defs": defs}
    lark = [
        f"calls: {'call+' if parallel else 'call'}",
        f'call: "{OPEN}" body "{CLOSE}"',
        f"body: %json {json.dumps({**body, 'x-guidance': _COMPACT})}",
    ]
    if choice == "auto":
        lark = ["start: TEXT | calls", r"TEXT: /[^<][\s\S]*/", *lark]
    else:
        lark = ["start: calls", *lark]
    return LLMatcher.grammar_from_lark("\n".join(lark))


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Grammar for `response_format`: any JSON object, or one matching the schema."""
    schema = schema if schema is not None else {"type": "object"}
    # Compact JSON: a small model given free whitespace tends to spend its tokens on it.
    return LLMatcher.grammar_from_json_schema({**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}})


def tools_system_prompt(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> str:
    """The documented generic format, for chat templates that have no tool support of their own."""
    specs = "\n".join(json.dumps({"name": t["function"]["name"], "description": t["function"].get("description", ""),
                                  "parameters": t["function"].get("parameters") or {}}) for t in tools)
    must = "You must call a function." if choice != "auto" else "Call a function only when it helps; otherwise answer."
    return (
        "You can call these functions (JSON Schema of their arguments):\n"
        f"{specs}\n"
        f"To call one, reply with {OPEN}{{\"name\": <function name>, \"arguments\": <arguments object>}}{CLOSE} "
        f"(one block per call) and nothing else. {must} Function results come back in <tool_response> blocks."
    )


def template_knows_tools(template_source: str) -> bool:
    return "tools" in template_source


def history_for_generic_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls become their <tool_call> text and tool results become user turns, which any
    chat template can render."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(
                OPEN + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])})
                + CLOSE for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append(m)
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls in a finished reply, OpenAI-shaped; None if the reply is plain text."""
    if not text.startswith(OPEN):
        return None
    calls = []
    for body in re.findall(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, flags=re.S):
        obj = json.loads(body)
        # The arguments exactly as generated (what streaming clients received), not re-serialised.
        head = '{"name":' + json.dumps(obj["name"]) + ',"arguments":'
        args = body[len(head) : -1] if body.startswith(head) else json.dumps(obj["arguments"])
        calls.append({"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}})
    return calls


@dataclass
class ToolStream:
    """Turns streamed reply text into content deltas or tool-call deltas, as OpenAI streams them:
    `id`, `type` and `function.name` on the first delta of each index, argument fragments after."""

    text: str = ""
    sent: int = 0  # characters of `text` already turned into deltas
    mode: str = "undecided"  # undecided | content | calls
    index: int = -1
    ids: list[str] = field(default_factory=list)
    in_args: bool = False

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        """Delta dicts for the chat chunk ({"content": ...} or {"tool_calls": [...]})."""
        self.text += piece
        if self.mode == "undecided":
            if self.text.startswith(OPEN):
                self.mode = "calls"
            elif not OPEN.startswith(self.text) or final:
                self.mode = "content"
            else:
                return []
        if self.mode == "content":
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return [{"content": out}] if out else []
        return self._calls(final)

    def _calls(self, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            rest = self.text[self.sent :]
            if not self.in_args:
                # A call opens with `<tool_call>{"name":"NAME","arguments":` (the grammar fixes the layout).
                head = re.match(re.escape(OPEN + '{"name":"') + r'((?:[^"\\]|\\.)*)","arguments":', rest)
                if not head:
                    return deltas
                self.index += 1
                self.ids.append(new_call_id())
                deltas.append({"tool_calls": [{"index": self.index, "id": self.ids[-1], "type": "function",
                                               "function": {"name": json.loads('"' + head.group(1) + '"'),
                                                            "arguments": ""}}]})
                self.sent += head.end()
                self.in_args = True
                continue
            end = rest.find("}" + CLOSE)
            if end >= 0:  # the arguments end just before the call object's closing brace
                if end:
                    deltas.append(self._args(rest[:end]))
                self.sent += end + 1 + len(CLOSE)
                self.in_args = False
                continue
            # Inside the arguments: hold back what could be the start of "}</tool_call>".
            safe = len(rest) if final else len(rest) - len("}" + CLOSE)
            if safe > 0:
                deltas.append(self._args(rest[:safe]))
                self.sent += safe
            return deltas

    def _args(self, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": fragment}}]}
