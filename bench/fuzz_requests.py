"""Generated requests for the fuzz run (tests/server/test_fuzz.py and bench/fuzz.py).

Two sources, each generator making its share (WEIGHTS) of a run:
- schemathesis, from the server's own /openapi.json: bodies that fit the schema (positive) and bodies
  that break it in one place (negative), for every operation;
- hypothesis, for what a schema cannot express: broken JSON, odd encodings, pathological JSON Schemas
  in `tools[].function.parameters` and `response_format.json_schema.schema`, huge and negative
  numbers, very long strings, deep nesting.

Every request that could reach the engine is kept cheap, so that thousands fit in a few minutes:
`max_tokens` and `max_completion_tokens` are capped at MAX_TOKENS (and set when null, or when the body
leaves both out, since the server would then generate to the end of the context), `n` and `best_of` at
MAX_N. Values the server must refuse before any work (negative, zero, wrong type, more than the
context or than the schema allows) are left as drawn: those are what the fuzzer is for.
"""

from __future__ import annotations

import base64
import json
from urllib.parse import quote
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NotSet

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 4
MAX_N = 2
# max_tokens above this is refused (context_length_exceeded) before any work, whatever the prompt.
REFUSED_TOKENS = 10**6
# Names the router knows whatever its configuration; a random string is nearly always a 404, which
# would leave the engine and the router's rules untested.
ROUTED_NAMES = ("auto", "gpt-5.6", "sol", "terra", "luna", "gpt-5.6-sol", "gpt-5.6-terra", "gpt-5.6-luna")


@dataclass(frozen=True)
class FuzzRequest:
    kind: str  # which generator made it
    method: str
    path: str  # with its query string
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The request whole, as JSON can hold it (the body in base64: it may be any bytes)."""
        return {"kind": self.kind, "method": self.method, "path": self.path, "headers": self.headers,
                "body_b64": None if self.body is None else base64.b64encode(self.body).decode()}

    def reproduction(self, limit: int = 600) -> str:
        """The request as a line a reader can replay (the body cut at `limit` bytes, its length said)."""
        body = "" if self.body is None else f" body({len(self.body)} B)={self.body[:limit]!r}"
        extra = {k: v for k, v in self.headers.items() if k.lower() != "content-type"}
        return f"[{self.kind}] {self.method} {self.path}{body}" + (f" headers={extra}" if extra else "")


def _json(body: Any) -> bytes:
    # allow_nan: NaN and Infinity are what json.loads on the server accepts, so they are fair input.
    return json.dumps(body, allow_nan=True).encode()


def cap(body: Any) -> Any:
    """The body with its output kept cheap (see the module's docstring); anything else unchanged."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        v = out.get(key)
        if (type(v) is int and MAX_TOKENS < v <= REFUSED_TOKENS) or (key in out and v is None):
            out[key] = MAX_TOKENS  # null, like absent, means to the end of the context
    if "max_tokens" not in out and "max_completion_tokens" not in out:
        out["max_tokens"] = MAX_TOKENS
    for key in ("n", "best_of"):
        v = out.get(key)
        if type(v) is int and MAX_N < v <= 128:  # above 128 the schema refuses it
            out[key] = MAX_N
    return out


def _post(kind: str, path: str, body: Any) -> FuzzRequest:
    return FuzzRequest(kind, "POST", path, _json(cap(body)), {"Content-Type": "application/json"})


# --- schemathesis ---------------------------------------------------------------------------------
def schema_requests(doc: dict[str, Any], model: str) -> dict[str, st.SearchStrategy[FuzzRequest]]:
    """Strategies from the OpenAPI document: positive cases of every operation, negative ones of the
    operations that take input. `model` replaces the generated model name in half of the bodies."""
    schema = schemathesis.openapi.from_dict(doc)
    names = st.sampled_from((model, *ROUTED_NAMES))

    @st.composite
    def from_case(draw: st.DrawFn, operations: list[Any], mode: GenerationMode) -> FuzzRequest:
        op = draw(st.sampled_from(operations))
        case = draw(op.as_strategy(generation_mode=mode))
        path = case.formatted_path
        if case.query:
            path += "?" + "&".join(f"{k}={v}" for k, v in case.query.items())
        headers = {str(k): str(v) for k, v in (case.headers or {}).items()}
        body = case.body
        if case.method.upper() != "POST" or isinstance(body, NotSet):
            return FuzzRequest(f"schema-{mode.value}", case.method.upper(), path, None, headers)
        if isinstance(body, dict) and isinstance(body.get("model"), str) and draw(st.booleans()):
            body = {**body, "model": draw(names)}
        headers.setdefault("Content-Type", case.media_type or "application/json")
        raw = body if isinstance(body, bytes) else _json(cap(body))  # negative cases may send other media types
        return FuzzRequest(f"schema-{mode.value}", "POST", path, raw, headers)

    ops = [r.ok() for r in schema.get_all_operations() if hasattr(r, "ok")]
    taking_input = [op for op in ops if op.method.upper() == "POST" or "{" in op.path]
    posts = [op for op in ops if op.method.upper() == "POST"]
    return {
        "schema-positive": from_case(ops, GenerationMode.POSITIVE),
        "schema-positive-post": from_case(posts, GenerationMode.POSITIVE),
        "schema-negative": from_case(taking_input, GenerationMode.NEGATIVE),
    }


# --- hypothesis: what the schema cannot express ------------------------------------------------------
def _text(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(max_size=max_size)


def valid_bodies(model: str) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(path, body) that the server accepts: the base every mutation below starts from."""
    names = st.sampled_from((model, model, model, *ROUTED_NAMES))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                                     "content": _text(60).filter(bool)})
    chat = st.fixed_dictionaries(
        {"model": names, "messages": st.lists(message, min_size=1, max_size=3)},
        optional={"max_tokens": st.integers(1, MAX_TOKENS), "stream": st.booleans(),
                  "temperature": st.floats(0, 2), "seed": st.integers(0, 2**31), "n": st.integers(1, MAX_N)})
    completion = st.fixed_dictionaries(
        {"model": names, "prompt": _text(60).filter(bool)},
        optional={"max_tokens": st.integers(1, MAX_TOKENS), "stream": st.booleans(), "echo": st.booleans()})
    return st.one_of(st.tuples(st.just(CHAT), chat), st.tuples(st.just(COMPLETIONS), completion))


def broken_json(model: str) -> st.SearchStrategy[FuzzRequest]:
    """Bodies that are not one JSON object: cut short, trailing garbage, JSON5-isms, other types."""
    fixed = st.sampled_from([
        b"", b" ", b"null", b"[]", b'"text"', b"123", b"true", b"{", b"}", b"{}", b"{,}", b"[1, 2]",
        b'{"model": "m",}', b"{'model': 'm'}", b"{model: 1}", b'{"model": "m"} {"model": "m"}',
        b'{"model": "m" /* c */}', b'{"model": NaN}', b'{"a": 1e999}', b'{"model": "m", "model": 5}',
        b'{"messages": [}', b'{"\\x": 1}', b'{"a": "\\u12"}', b'{"a": "\x01"}', b"\x00" * 16,
    ])

    @st.composite
    def cut(draw: st.DrawFn) -> bytes:
        path, body = draw(valid_bodies(model))
        raw = _json(cap(body))
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]

    @st.composite
    def garbage(draw: st.DrawFn) -> bytes:
        _, body = draw(valid_bodies(model))
        return _json(cap(body)) + draw(st.sampled_from([b"x", b",", b"}", b"]", b"{}", b"\x00", b" 1"]))

    raw = st.one_of(fixed, cut(), garbage(), st.binary(max_size=200))
    path = st.sampled_from([CHAT, COMPLETIONS])
    ctype = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])
    return st.builds(lambda b, p, c: FuzzRequest("broken-json", "POST", p, b, {"Content-Type": c} if c else {}),
                     raw, path, ctype)


_INVALID_UTF8 = [b"\xff", b"\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\x80"]
_ESCAPES = [r"\ud800", r"\udfff", r"\ud800\ud800", r"\udc00\ud800", r"\ud83d\ude00", r"\u0000", r"\ufeff",
            r"\ud800x", r"\uDBFF\uDFFF"]


def odd_encodings(model: str) -> st.SearchStrategy[FuzzRequest]:
    """A valid body made odd in its bytes: invalid UTF-8 inside a string, a BOM, UTF-16 and UTF-32,
    lone and reversed surrogates written as escapes."""

    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        path, body = draw(valid_bodies(model))
        marker = "MARKER-7f3a"
        key = "messages" if path == CHAT else "prompt"
        if key == "messages":
            body["messages"] = [*body["messages"][:-1], {"role": "user", "content": f"hi {marker}"}]
        else:
            body["prompt"] = f"hi {marker}"
        raw = _json(cap(body))
        how = draw(st.sampled_from(["bytes", "escape", "bom", "utf16", "utf32", "latin1"]))
        if how == "bytes":
            raw = raw.replace(marker.encode(), draw(st.sampled_from(_INVALID_UTF8)))
        elif how == "escape":
            raw = raw.replace(marker.encode(), draw(st.sampled_from(_ESCAPES)).encode())
        elif how == "bom":
            raw = b"\xef\xbb\xbf" + raw
        elif how == "utf16":
            raw = raw.decode().encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-16-be"])))
        elif how == "utf32":
            raw = raw.decode().encode(draw(st.sampled_from(["utf-32", "utf-32-le"])))
        else:
            raw = raw.replace(marker.encode(), "café ñ".encode("latin-1"))
        return FuzzRequest(f"encoding-{how}", "POST", path, raw, {"Content-Type": "application/json"})

    return build()


# JSON Schema keywords and values that are legal, illegal or merely expensive.
_SCHEMA_KEYS = ["type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf", "allOf", "not",
                "$ref", "$defs", "definitions", "additionalProperties", "pattern", "minLength", "maxLength",
                "minimum", "maximum", "multipleOf", "minItems", "maxItems", "format", "patternProperties",
                "prefixItems", "uniqueItems", "$schema", "x-guidance", "if", "then", "else", "dependentRequired"]
_ODD_VALUES = st.sampled_from([
    [], {}, None, True, False, 0, -1, 10**20, -(10**20), 1e308, 0.5, "", "object", "string", "integer", "null",
    ["string", "null"], "(a+)+$", "[", "\\", "^(?=a)", "a{0,100000}", "#", "#/$defs/x", "#/nope", "date-time",
    "x" * 300,
])


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def pathological_schemas() -> st.SearchStrategy[Any]:
    soup = st.recursive(
        _ODD_VALUES,
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.sampled_from(_SCHEMA_KEYS), inner, max_size=5)),
        max_leaves=20)
    return st.one_of(
        st.integers(1, 120).map(_deep),
        st.integers(1, 5000).map(lambda n: {"type": "string", "enum": [f"v{i}" for i in range(n)]}),
        st.integers(1, 500).map(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                            for i in range(n)},
                                           "required": [f"p{i}" for i in range(n)]}),
        st.sampled_from([
            {"$ref": "#"},
            {"type": "object", "properties": {"x": {"$ref": "#"}}},
            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
            {"$ref": "#/$defs/missing"},
            {"$ref": "http://example.invalid/schema.json"},
            {"type": "object", "$schema": []},
            {"type": "object", "x-guidance": 1},
            {"type": "object", "x-guidance": {"whitespace_flexible": "yes"}},
            {"type": "string", "pattern": "(a+)+$"},
            {"type": "string", "pattern": "["},
            {"type": "string", "minLength": 10**6},
            {"type": "string", "minLength": 5, "maxLength": 2},
            {"type": "integer", "minimum": 10, "maximum": -10},
            {"type": "number", "multipleOf": 0},
            {"type": "array", "minItems": 10**6},
            {"type": "array", "items": []},
            {"type": []},
            {"type": "nonsense"},
            {"not": {}},
            {"anyOf": []},
            {"allOf": [{"type": "string"}, {"type": "integer"}]},
            {"type": "object", "required": ["missing"], "additionalProperties": False},
        ]),
        soup,
    )


def schemas_in_place(model: str) -> st.SearchStrategy[FuzzRequest]:
    """A pathological schema as a tool's parameters or as response_format's schema."""

    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        schema = draw(pathological_schemas())
        body: dict[str, Any] = {"model": draw(st.sampled_from([model, model, "auto"])),
                                "messages": [{"role": "user", "content": "Call the tool."}],
                                "max_tokens": draw(st.integers(1, MAX_TOKENS))}
        if draw(st.booleans()):
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
            body["tool_choice"] = draw(st.sampled_from(["auto", "required", "none",
                                                        {"type": "function", "function": {"name": "f"}}]))
            kind = "schema-in-tools"
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
            kind = "schema-in-response-format"
        body["stream"] = draw(st.booleans())
        return FuzzRequest(kind, "POST", CHAT, _json(body), {"Content-Type": "application/json"})

    return build()


_NUMERIC = ["max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "top_logprobs", "logprobs", "best_of"]
_EXTREMES = [0, -0.0, -1, -(2**31), -(2**63) - 1, 2**31, 2**63, 2**64, 10**30, 10**300, 10**4000, -(10**4000),
             1e308, -1e308, 1e-300, 5e-324, float("inf"), float("-inf"), float("nan"), 0.5, 1.0000000000000002,
             2.0000000000000004, -2.0000000000000004, 128, 129, 65]


def extreme_numbers(model: str) -> st.SearchStrategy[FuzzRequest]:
    """One or more numeric parameters set to huge, tiny, negative or non-finite values, or to token ids
    and logit_bias entries out of range."""
    value = st.one_of(st.sampled_from(_EXTREMES), st.integers(), st.floats(allow_nan=True, allow_infinity=True))
    big_ints = st.one_of(st.sampled_from([-1, -(2**63), 2**63, 10**30, 10**4000]), st.integers())

    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        path, body = draw(valid_bodies(model))
        for key in draw(st.lists(st.sampled_from(_NUMERIC), min_size=1, max_size=3, unique=True)):
            body[key] = draw(value)
        if draw(st.booleans()):
            body["stop_token_ids"] = draw(st.lists(big_ints, min_size=1, max_size=3))
        if draw(st.booleans()):
            body["logit_bias"] = {str(draw(big_ints)): draw(value)}
        if path == COMPLETIONS and draw(st.booleans()):
            body["prompt"] = draw(st.lists(big_ints, min_size=1, max_size=4))
        return _post("extreme-numbers", path, body)

    return build()


def long_strings(model: str, longest: int) -> st.SearchStrategy[FuzzRequest]:
    """A very long string in one place (up to `longest` characters): content, prompt, model name, stop,
    user, metadata, a tool's name or description, a tool call's arguments, the router's phrases."""
    size = st.sampled_from([n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= longest])
    unit = st.sampled_from(["a", "word ", "first then ", "é", "\U0001f600", "\n", "{", "<tool_call>", " "])

    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        path, body = draw(valid_bodies(model))
        u = draw(unit)
        text = u * max(1, draw(size) // len(u.encode()))
        where = draw(st.sampled_from(["content", "model", "stop", "user", "metadata", "tool", "arguments", "part"]))
        if where == "content":
            if path == CHAT:
                body["messages"][-1]["content"] = text
            else:
                body["prompt"] = text
        elif where == "model":
            body["model"] = text
        elif where == "stop":
            body["stop"] = [text]
        elif where == "user":
            body["user"] = text
        elif where == "metadata":
            body["metadata"] = {text[:1000]: text}
        else:
            path = CHAT
            body = {"model": draw(st.sampled_from([model, "auto"])), "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}]}
            if where == "tool":
                body["tools"] = [{"type": "function", "function": {"name": text[:64], "description": text}}]
            elif where == "arguments":
                body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}]}]
            else:
                body["messages"] = [{"role": "user", "content": [
                    {"type": "text", "text": "hi"}, {"type": draw(st.sampled_from(["image_url", "text"])),
                                                     "text": text if draw(st.booleans()) else 5}]}]
        return _post(f"long-{where}", path, body)

    return build()


def deep_nesting(model: str) -> st.SearchStrategy[FuzzRequest]:
    """Arrays or objects nested deep, in a field the server ignores, in content or in a schema."""
    depth = st.sampled_from([10, 100, 500, 900, 1000, 2000, 100_000])

    @st.composite
    def build(draw: st.DrawFn) -> FuzzRequest:
        path, body = draw(valid_bodies(model))
        d = draw(depth)
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        nested = opener * d + b"1" + closer * d
        where = draw(st.sampled_from(["extra", "content", "schema", "logit_bias", "metadata"]))
        placeholder = "NESTED-PLACEHOLDER"
        if where == "extra":
            body["extra"] = placeholder
        elif where == "content" and path == CHAT:
            body["messages"][-1]["content"] = placeholder
        elif where == "content":
            body["prompt"] = placeholder
        elif where == "schema":
            path = CHAT
            body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": placeholder}}}
        else:
            body[where] = {"1": placeholder}
        raw = _json(cap(body)).replace(json.dumps(placeholder).encode(), nested)
        return FuzzRequest(f"deep-{where}", "POST", path, raw, {"Content-Type": "application/json"})

    return build()


def odd_messages(model: str) -> st.SearchStrategy[FuzzRequest]:
    """Conversations of odd shape: tool turns without calls, calls without tools, garbage arguments,
    content parts, empty strings, names and ids of every kind."""
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": _text()}),
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file", "refusal", "text"])},
                              optional={"text": st.one_of(_text(), st.integers()), "image_url": st.just({"url": "x"})}))
    content = st.one_of(st.none(), _text(), st.lists(part, max_size=3))
    call = st.fixed_dictionaries({"id": _text(10), "type": st.just("function"),
                                  "function": st.fixed_dictionaries({"name": _text(10), "arguments": st.one_of(
                                      _text(), st.sampled_from(["{}", "[" * 1000, '{"a": ', "null", "1e999"]))})})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]), "content": content},
        optional={"name": _text(20), "tool_calls": st.lists(call, max_size=2), "tool_call_id": _text(10)})
    body = st.fixed_dictionaries(
        {"model": st.sampled_from([model, model, "auto"]), "messages": st.lists(message, min_size=1, max_size=4),
         "max_tokens": st.integers(1, MAX_TOKENS)},
        optional={"stream": st.booleans(), "tool_choice": st.sampled_from(["auto", "none", "required"]),
                  "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])})
    return body.map(lambda b: _post("odd-messages", CHAT, b))


RESPONSES = "/v1/responses"
# What a field of a Responses item or parameter may hold instead of what the API's types say.
_ODD = st.sampled_from([None, [1], {}, {"a": 1}, 5, -1, 1.5, True, "", "x", "\u00b2", "a" * 1000, ["a"],
                        "\U0001f600", "resp_" + "0" * 24])


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the value the API wants, sometimes an odd one."""
    return st.one_of(value, value, value, _ODD)


def responses_items() -> st.SearchStrategy[Any]:
    """An input item of /v1/responses: each kind the server takes, with its fields (ids, statuses,
    a call's `caller` in every form) now and then of another type or value."""
    text = _text(30)
    part = st.fixed_dictionaries({"type": _maybe(st.sampled_from(["input_text", "output_text", "refusal",
                                                                 "input_image", "summary_text"])),
                                  "text": _maybe(text)})
    content = st.one_of(text, st.lists(part, max_size=3), _ODD)
    common = {"id": _maybe(st.sampled_from(["msg_1", "fc_1", "item_1"])), "status": _maybe(st.sampled_from(
        ["completed", "in_progress", "incomplete"]))}
    call_id = _maybe(st.sampled_from(["call_1", "call_2"]))
    caller = st.one_of(st.none(), st.just({"type": "direct"}), st.just("x"), st.just({}), st.just({"type": "program"}),
                       st.fixed_dictionaries({"type": _maybe(st.just("program")), "caller_id": _maybe(call_id)}), _ODD)
    kinds = [
        st.fixed_dictionaries({"role": _maybe(st.sampled_from(["user", "assistant", "system", "developer"])),
                               "content": content}, optional={"type": st.just("message"), **common}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": call_id, "name": _maybe(st.just("f")),
                               "arguments": _maybe(st.sampled_from(["{}", '{"a": 1}', "[" * 100]))},
                              optional={"caller": caller, **common}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": call_id,
                               "output": st.one_of(_maybe(text), st.lists(part, max_size=2))}, optional=common),
        st.fixed_dictionaries({"type": st.just("program"), "call_id": call_id, "code": _maybe(st.just("print(1)"))},
                              optional={"fingerprint": _maybe(st.just("x")), **common}),
        st.fixed_dictionaries({"type": st.just("program_output"), "call_id": call_id, "result": _maybe(text)},
                              optional={"error": _maybe(text), **common}),
        st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"summary": _maybe(st.just([])), **common}),
        st.fixed_dictionaries({"type": st.just("item_reference"), "id": _maybe(st.just("msg_nothing"))}),
        st.fixed_dictionaries({"type": _ODD}),
        _ODD,
    ]
    return st.one_of(*kinds)


def responses_requests(model: str) -> st.SearchStrategy[FuzzRequest]:
    """/v1/responses: bodies of odd items and parameters (kept cheap: at most MAX_TOKENS out, Ultra's
    sub-agents as few and as short), and the GET and DELETE endpoints with odd ids and query strings
    (`limit` in Unicode digits or thousands of digits, odd `order` and `after`)."""
    tool = st.one_of(
        st.just({"type": "function", "name": "f", "parameters": {"type": "object"}}),
        st.just({"type": "function", "name": "g", "allowed_callers": ["programmatic"],
                 "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}),
        st.just({"type": "programmatic_tool_calling"}),
        st.fixed_dictionaries({"type": _maybe(st.just("function")), "name": _maybe(st.just("h")),
                               "allowed_callers": _maybe(st.just(["direct"]))}),
    )
    multi_agent = st.fixed_dictionaries({}, optional={
        "enabled": _maybe(st.booleans()), "max_concurrent_subagents": _maybe(st.integers(1, 2)),
        "subagent_model": _maybe(st.sampled_from([model, "luna", "no-such-model"])),
        "max_output_tokens_per_agent": _maybe(st.integers(1, MAX_TOKENS))})
    body = st.fixed_dictionaries(
        {"model": _maybe(st.sampled_from((model, model, model, *ROUTED_NAMES))),
         "input": st.one_of(_text(40), st.lists(responses_items(), max_size=4), _ODD)},
        optional={"max_output_tokens": _maybe(st.integers(1, MAX_TOKENS)), "stream": _maybe(st.booleans()),
                  "store": _maybe(st.booleans()), "tools": st.one_of(st.lists(tool, max_size=3), _ODD),
                  "tool_choice": _maybe(st.sampled_from(["auto", "none", "required"])),
                  "instructions": _maybe(_text(20)), "previous_response_id": _ODD,
                  "text": st.one_of(st.just({"format": {"type": "json_object"}}), _ODD),
                  "reasoning": st.one_of(st.fixed_dictionaries({"effort": _maybe(st.sampled_from(
                      ["none", "low", "ultra"]))}), _ODD),
                  "metadata": _maybe(st.just({"k": "v"})), "temperature": _maybe(st.floats(0, 2)),
                  "truncation": _maybe(st.sampled_from(["auto", "disabled"])), "user": _maybe(_text(10))})

    @st.composite
    def post(draw: st.DrawFn) -> FuzzRequest:
        b = draw(body)
        if "max_output_tokens" not in b or b["max_output_tokens"] is None or (
                type(b["max_output_tokens"]) is int and b["max_output_tokens"] > MAX_TOKENS):
            b["max_output_tokens"] = MAX_TOKENS  # absent or null: to the end of the context
        if draw(st.integers(0, 29)) == 0:  # Ultra, now and then: a plan's turn and its sub-agents' cost more
            b["multi_agent"] = draw(multi_agent)
            if draw(st.booleans()) and isinstance(b["model"], str):
                b["model"] += "-ultra"
        if isinstance(b.get("multi_agent"), dict):
            ma = b["multi_agent"]
            if type(ma.get("max_output_tokens_per_agent")) is not int or ma["max_output_tokens_per_agent"] > MAX_TOKENS:
                ma.setdefault("max_output_tokens_per_agent", MAX_TOKENS)
            if type(ma.get("max_concurrent_subagents")) is int and ma["max_concurrent_subagents"] > 2:
                ma["max_concurrent_subagents"] = 2
        return FuzzRequest("responses-post", "POST", RESPONSES, _json(b), {"Content-Type": "application/json"})

    rid = st.sampled_from(["resp_nothing", "resp_" + "0" * 24, "%00", "..", "\u00b2", "a" * 2000, " ", "%ZZ"])
    limit = st.sampled_from(["\u00b2", "\u0661", "\uff11", "9" * 5000, "0", "-1", "101", "1e2", " 5", "5 ", "",
                             "abc", "100", "1", "+5", "05", "0x10"])

    @st.composite
    def read(draw: st.DrawFn) -> FuzzRequest:
        which = draw(st.sampled_from(["get", "delete", "items"]))
        path = f"{RESPONSES}/{quote(draw(rid), safe='%')}"
        if which != "items":
            return FuzzRequest("responses-" + which, which.upper(), path)
        query = {k: draw(v) for k, v in (("limit", limit), ("order", _maybe(st.sampled_from(["asc", "desc"]))),
                                         ("after", _maybe(st.just("msg_1")))) if draw(st.booleans())}
        qs = "&".join(f"{k}={quote(str(v))}" for k, v in query.items())
        return FuzzRequest("responses-items", "GET", path + "/input_items" + (f"?{qs}" if qs else ""))

    return st.one_of(post(), post(), post(), read())


# Each generator's share of a run: the schema's cases, which are most of what clients send, most.
WEIGHTS = {
    "schema-positive": 2, "schema-positive-post": 3, "schema-negative": 3,
    "broken-json": 1, "odd-encodings": 1, "pathological-schemas": 2, "extreme-numbers": 2, "long-strings": 1,
    "deep-nesting": 1, "odd-messages": 2, "responses": 3,
}


def generators(doc: dict[str, Any], model: str,
               longest: int = 1_000_000) -> dict[str, st.SearchStrategy[FuzzRequest]]:
    """Every generator above by name (the keys of WEIGHTS). `doc`: the server's /openapi.json;
    `model`: a name it serves; `longest`: the longest of the long strings, in characters (a million
    makes bodies of up to 4 MB, the server's limit, which take seconds of CPU each to refuse)."""
    return {
        **schema_requests(doc, model),
        "broken-json": broken_json(model), "odd-encodings": odd_encodings(model),
        "pathological-schemas": schemas_in_place(model), "extreme-numbers": extreme_numbers(model),
        "long-strings": long_strings(model, longest), "deep-nesting": deep_nesting(model), "odd-messages": odd_messages(model),
        "responses": responses_requests(model),
    }


def quotas(total: int, only: list[str] | None = None) -> dict[str, int]:
    """How many of `total` requests each generator (of `only`, by default all) makes: by WEIGHTS, at
    least one each, summing to `total` or more."""
    chosen = {name: w for name, w in WEIGHTS.items() if only is None or name in only}
    if only is not None and set(only) - set(chosen):
        raise ValueError(f"no generator {sorted(set(only) - set(chosen))}; there are {sorted(WEIGHTS)}")
    weight = sum(chosen.values())
    return {name: max(1, -(-total * w // weight)) for name, w in chosen.items()}
