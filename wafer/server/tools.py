"""Tool calling and structured output: grammars from JSON Schemas, the prompt format for models
whose template knows no tools, and parsing the model's calls (whole or streamed).

A call is the JSON object `{"name": NAME, "arguments": {...}}`, written either tagged,
`<tool_call>{...}</tool_call>` (Qwen2.5's template, and the generic prompt below), or bare, as
the reply's first thing (as Qwen2.5-Coder's small models write it). With `tool_choice: "auto"`
the reply is free text unless a call begins, after any text for a tagged call and at the very
start for a bare one; from its first characters on, the grammar holds the call to its schema (a
lazily triggered grammar, as llama.cpp's "grammar triggers"). Like llama.cpp's Hermes/Qwen
handler, a reply that opens `{"name"` is a call; other text that starts with `{` stays text.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from llguidance import LLMatcher

from wafer import untrusted_json
from wafer.engine.constraints import CALL_CLOSE, CALL_OPEN
from wafer.server.finite_schema import unbounded_part
from wafer.server.errors import bad_request

OPEN, CLOSE = CALL_OPEN, CALL_CLOSE
log = logging.getLogger("wafer.tools")
# Compact separators for `response_format` JSON: a small model given free whitespace tends to spend
# its tokens on it.
_COMPACT = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
# A call's arguments are laid out as the model writes them (`{"city": "Paris"}`, or on indented
# lines in a ```json block, as Qwen2.5-Coder's small models do): a grammar that allowed only the
# compact form would turn each `": "` the model means into tokens it never saw there. Bounded, so that
# whitespace cannot run on.
_AS_WRITTEN = {"whitespace_flexible": True, "whitespace_pattern": r"[ \n]{1,24}"}
# How a bare call opens: `{"name": "`, spaced or laid out on lines, maybe in a ```json block.
_WS = r"[ \n]{0,8}"
_HEAD = rf'{_WS}\{{{_WS}"name"{_WS}:{_WS}"'
_FENCES = ("```json\n", "```\n")
_NOT_BARE = rf'~/(```(json)?\n)?{_WS}\{{{_WS}"name"(.|\n)*/'


# Deeper than this, a schema is refused: the checks and the grammar compiler recurse once a level or
# more (OpenAI's own structured outputs allow 10 levels).
MAX_SCHEMA_DEPTH = 64


def _schema_depth(schema: Any) -> int:
    deepest, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise bad_request("must be a JSON Schema object", param)
    if _schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep", param)
    # Keywords whose type the checks below take for granted (validator_for hashes `$schema`).
    if not isinstance(schema.get("$schema", ""), str):
        raise bad_request("not a valid JSON Schema: '$schema' must be a string", param)
    if not isinstance(schema.get("x-guidance", {}), dict):
        raise bad_request("'x-guidance' must be an object of grammar options", param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise bad_request(f"not a valid JSON Schema: {e.message}", param) from None
    except RecursionError:  # a $ref cycle the meta-schema check follows
        raise bad_request("not a valid JSON Schema: its references recurse without end", param) from None
    part = unbounded_part(schema)
    if part is not None:
        raise bad_request(f"the schema admits no finite value: its part {part!r} requires itself again on every "
                          "branch (a recursive '$ref' that is required, or a '$ref' cycle), so no reply could ever "
                          "complete it", param)
    return schema


def closed(schema: Any, strict: bool = False) -> Any:
    """The schema with every object that does not say `additionalProperties` closed to the keys it
    lists, as xgrammar's strict mode reads them: a small model otherwise invents keys. Branches of
    `allOf` stay open, since each lists only part of the keys. `strict` (a request's `strict: true`):
    every object is closed whatever it says, as OpenAI's strict mode holds every object to
    `additionalProperties: false`, `allOf` included (its keys are then those the object lists)."""
    if isinstance(schema, list):
        return [closed(s, strict) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {k: closed(v, strict) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "not", "if", "then",
                     "else", "contains", "additionalItems", "unevaluatedItems"):
            out[key] = closed(value, strict)
        elif key == "allOf" and isinstance(value, list):
            out[key] = [{k: closed(v, strict) if k != "additionalProperties" else v for k, v in s.items()}
                        if isinstance(s, dict) else s for s in value]
        else:
            out[key] = value
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or "properties" in out
    if is_object and strict:
        out["additionalProperties"] = False
        out.pop("unevaluatedProperties", None)
    elif is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _lit(text: str) -> str:
    """A lark string literal for text."""
    return json.dumps(text)


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool,
                 special_tags: bool = False) -> str:
    """Lark grammar for the assistant's reply. `auto`: free text, or calls (tagged after any text,
    or bare from the start); `required`: one call or more (one, without parallel calls); a named
    function: that call. `special_tags`: the tokenizer has the tags as special tokens of their own
    (Qwen2.5's), which a grammar names as such rather than spells."""
    open_, close = (OPEN, CLOSE) if special_tags else (_lit(OPEN), _lit(CLOSE))
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        choice, parallel = "required", False
    lark = ["%llguidance {}"]
    for i, t in enumerate(tools):
        args = closed(t["function"].get("parameters") or {"type": "object"}, bool(t["function"].get("strict")))
        args = {**args, "x-guidance": {**_AS_WRITTEN, **args.get("x-guidance", {})}}
        lark += [
            f'tail_{i}: {_lit(t["function"]["name"] + chr(34))} WS? "," WS? "\\"arguments\\"" WS? ":" WS? '
            f'args_{i} WS? "}}"',
            f"args_{i}: %json {json.dumps(args)}",
        ]
    lark += [
        "tail: " + " | ".join(f"tail_{i}" for i in range(len(tools))),
        'obj: "{" WS? "\\"name\\"" WS? ":" WS? "\\"" tail',
        f"rest: WS? obj WS? {close}",
        f"tagged: {open_} rest",
        "more: WS? tagged",
        f"bare_lead[lazy]: /{_HEAD}/",
        f"fenced_lead[lazy]: /```(json)?\\n{_HEAD}/",
        'bare: bare_lead tail | fenced_lead tail WS? "```"',
        r"WS: /[ \n]{1,8}/",
    ]
    # A reply may end with blanks after its last call, as the model closes it (`</tool_call>\n`):
    # without them, the newline would leave the grammar waiting for another call, never the end.
    many = " more* WS?" if parallel else " WS?"
    bares = "bare+ WS?" if parallel else "bare WS?"
    if choice == "auto":
        text = f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{OPEN}(.|\\n)*/ & {_NOT_BARE}"
        if special_tags:  # a special token ends any text before it
            lark += [f"start: TEXT | TEXT? tagged{many} | {bares}", text]
        else:  # text up to the first tag is one lazy lexeme: it ends as soon as the tag is written
            lark += [f"start: TEXT | lead rest{many} | {bares}", f"lead[lazy]: /(.|\\n)*{OPEN}/ & {_NOT_BARE}", text]
    else:
        lark += [f"start: tagged{many} | {bares}"]
    return LLMatcher.grammar_from_lark("\n".join(lark))


def json_grammar(schema: dict[str, Any] | None, strict: bool = False) -> str:
    """Grammar for `response_format`: any JSON object, or one matching the schema (every object of
    it closed with `strict`, as OpenAI's strict mode)."""
    schema = schema if schema is not None else {"type": "object"}
    if strict:
        schema = closed(schema, strict=True)
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


def history_for_tool_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls' arguments as objects: templates with tool support (Qwen2.5's) write them with
    `tojson`, which would quote OpenAI's argument strings a second time (vLLM parses them too)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _loads(text: str) -> Any:
    try:
        return untrusted_json.loads(text)
    except (TypeError, ValueError):  # kept as the text it is
        return text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _object_end(text: str, start: int) -> int:
    """The index just past the JSON object that opens at text[start], or -1 if it has not ended."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def _call(obj_text: str) -> dict[str, Any] | None:
    """One finished call object, OpenAI-shaped, its arguments exactly as generated (what a streaming
    client would have received), not re-serialised; None if it is not a call."""
    try:
        obj = untrusted_json.loads(obj_text)
        name, args = obj["name"], obj["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    key = obj_text.find('"arguments"')
    start = obj_text.index(":", key) + 1
    while obj_text[start] in " \n":
        start += 1
    raw = obj_text[start:_object_end(obj_text, start)]
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": raw}}


def _bare_head(text: str) -> str:
    """Whether text opens a bare call: "yes", "no", or "maybe" (it still could)."""
    for fence in _FENCES:
        if text.startswith(fence):
            text = text[len(fence) :]
            break
        if fence.startswith(text):
            return "maybe"
    text = text.lstrip(" \n")
    if not text:
        return "maybe"
    if text[0] != "{":
        return "no"
    text = text[1:].lstrip(" \n")
    if text.startswith('"name"'):
        return "yes"
    return "maybe" if '"name"'.startswith(text) else "no"


@dataclass
class CallParser:
    """Splits a reply, whole or as it streams, into content and complete calls. A call is passed on
    only once its JSON has closed, so that one cut short by max_tokens is dropped (`dropped`), never
    sent in part nor as text."""

    text: str = ""
    pos: int = 0  # characters of `text` already passed on
    mode: str = "start"  # start | text | calls
    calls: list[dict[str, Any]] = field(default_factory=list)
    dropped: bool = False

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        """Delta dicts for the chat chunk ({"content": ...} or {"tool_calls": [...]})."""
        self.text += piece
        deltas: list[dict[str, Any]] = []
        if self.mode == "start":
            head = _bare_head(self.text)
            if self.text.startswith(OPEN) or head == "yes":
                self.mode = "calls"
            elif OPEN.startswith(self.text) or head == "maybe":
                if not final:
                    return deltas
                self.mode = "calls"  # a call cut before its name
            else:
                self.mode = "text"
        if self.mode == "text":
            tag = self.text.find(OPEN, self.pos)
            end = tag if tag >= 0 else len(self.text)
            if tag < 0 and not final:
                # Hold back what could be the start of a tag, and blanks that would precede one.
                for k in range(min(len(OPEN) - 1, end - self.pos), 0, -1):
                    if OPEN.startswith(self.text[end - k :]):
                        end -= k
                        break
                end = self.pos + len(self.text[self.pos : end].rstrip())
            out = self.text[self.pos : end]
            if tag >= 0:
                out = out.rstrip()
            if out:
                deltas.append({"content": out})
            self.pos = end
            if tag < 0:
                return deltas
            self.mode, self.pos = "calls", tag
        return deltas + self._calls(final)

    def _calls(self, final: bool) -> list[dict[str, Any]]:
        deltas = []
        while True:
            rest = self.text[self.pos :]
            stripped = rest.lstrip(" \n")
            self.pos += len(rest) - len(stripped)
            for tag in (OPEN, CLOSE, *_FENCES, "```"):
                if stripped.startswith(tag):
                    self.pos += len(tag)
                    break
            else:
                if not stripped.startswith("{"):
                    break
                end = _object_end(self.text, self.pos)
                if end < 0:
                    break
                call = _call(self.text[self.pos : end])
                self.pos = end
                if call is None:
                    continue
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, **call}]})
        if final and "{" in self.text[self.pos :]:
            self.dropped = True
            log.info("a tool call cut short by max_tokens was dropped: %r", self.text[self.pos :][:200])
        return deltas


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]], bool]:
    """A finished reply's content (None if empty), its complete calls, and whether a call cut short
    was dropped."""
    parser = CallParser()
    content = "".join(d["content"] for d in parser.feed(text, final=True) if "content" in d)
    if parser.calls or parser.dropped:
        content = content.strip()
    return content or None, parser.calls, parser.dropped
