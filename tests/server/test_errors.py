"""Bad requests, table-driven: each gets its status and an OpenAI-shaped error; the server stays up."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving import MODEL, start_server
from wafer.errors import server_error

OK_MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def chat(**kw):
    return {"model": MODEL, "messages": OK_MSG, **kw}


def _nested(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# Past the schemas' bound (64 levels of JSON, server/tools.py) and within the body's (128,
# wafer/untrusted_json.py), so that the schema's own check answers, naming the field.
DEEP = _nested(40)


# (name, method, path, body (dict, or raw bytes), expected status, expected param or None, expected code or None)
CASES = [
    ("malformed json", "POST", CHAT, b'{"model": ', 400, None, "invalid_json"),
    ("body not an object", "POST", CHAT, b"[1, 2]", 400, None, None),
    ("not utf-8", "POST", CHAT, b"\xff\xfe\x00", 400, None, "invalid_json"),
    ("missing model", "POST", CHAT, {"messages": OK_MSG}, 400, "model", "missing_required_parameter"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "messages", None),
    ("bad role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    ("no content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0]", None),
    ("content wrong type", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
    ("image part", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]}]),
     400, "messages[0].content", None),
    ("model wrong type", "POST", CHAT, chat(model=7), 400, "model", None),
    ("temperature string", "POST", CHAT, chat(temperature="hot"), 400, "temperature", None),
    ("temperature negative", "POST", CHAT, chat(temperature=-0.5), 400, "temperature", None),
    ("temperature huge", "POST", CHAT, chat(temperature=5), 400, "temperature", None),
    ("top_p above one", "POST", CHAT, chat(top_p=1.5), 400, "top_p", None),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-3), 400, "max_tokens", None),
    ("max_tokens float", "POST", CHAT, chat(max_tokens=2.5), 400, "max_tokens", None),
    ("max_tokens huge", "POST", CHAT, chat(max_tokens=10**9), 400, "messages", "context_length_exceeded"),
    ("max_completion_tokens zero", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    ("n zero", "POST", CHAT, chat(n=0), 400, "n", None),
    ("n too many", "POST", CHAT, chat(n=1000), 400, "n", None),
    ("n beyond the whole queue", "POST", CHAT, chat(n=65, max_tokens=1), 400, "n", None),
    ("prompts beyond the whole queue", "POST", COMP, {"model": MODEL, "prompt": ["a"] * 65, "max_tokens": 1}, 400,
     "prompt", None),
    ("2000 prompts", "POST", COMP, {"model": MODEL, "prompt": ["a"] * 2000, "max_tokens": 1}, 400, "prompt", None),
    ("stop too many", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("stop empty string", "POST", CHAT, chat(stop=""), 400, "stop", None),
    ("presence penalty range", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    ("frequency penalty type", "POST", CHAT, chat(frequency_penalty=[1]), 400, "frequency_penalty", None),
    ("logit_bias key", "POST", CHAT, chat(logit_bias={"hello": 1}), 400, "logit_bias", None),
    ("logit_bias value", "POST", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias.5", None),
    ("logit_bias token out of vocab", "POST", CHAT, chat(logit_bias={"999999": 1}), 400, "logit_bias", None),
    ("logit_bias key --1", "POST", CHAT, chat(logit_bias={"--1": 1}), 400, "logit_bias", None),
    ("logit_bias key superscript", "POST", CHAT, chat(logit_bias={"\u00b2": 1}), 400, "logit_bias", None),
    ("logit_bias key 5000 digits", "POST", CHAT, chat(logit_bias={"7" * 5000: 1}), 400, "logit_bias", None),
    ("integer of 5000 digits", "POST", CHAT, json.dumps(chat()).encode()[:-1] + b', "seed": ' + b"9" * 5000 + b"}",
     400, None, "invalid_json"),
    ("json nested 100000 deep", "POST", CHAT, b'{"model": "m", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400,
     None, "invalid_json"),
    # Under the interpreter's recursion limit, so json.loads alone parsed it (and, at that depth, a garbage
    # collection's callback could end the process: wafer/untrusted_json.py)
    ("json nested 900 deep", "POST", CHAT, b'{"model": "m", "x": ' + b"[" * 900 + b"]" * 900 + b"}", 400,
     None, "invalid_json"),
    ("lone surrogate in content", "POST", CHAT,
     json.dumps(chat(messages=[{"role": "user", "content": "hi \ud800"}])).encode(), 400, None, "invalid_json"),
    ("lone surrogate in prompt", "POST", COMP, json.dumps({"model": MODEL, "prompt": "a\udfff"}).encode(), 400, None,
     "invalid_json"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=3), 400, "top_logprobs", None),
    ("top_logprobs too many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("logprobs not bool", "POST", CHAT, chat(logprobs="yes"), 400, "logprobs", None),
    ("stream not bool", "POST", CHAT, chat(stream="yes"), 400, "stream", None),
    ("seed string", "POST", CHAT, chat(seed="abc"), 400, "seed", None),
    ("unknown model", "POST", CHAT, chat(model="gpt-nope"), 404, "model", "model_not_found"),
    ("over-long prompt", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 3000}]), 400, "messages",
     "context_length_exceeded"),
    ("completions suffix", "POST", COMP, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("completions bad prompt", "POST", COMP, {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", None),
    ("completions empty prompt list", "POST", COMP, {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("completions token out of vocab", "POST", COMP, {"model": MODEL, "prompt": [1, 2, 10**7]}, 400, "prompt", None),
    ("completions logprobs too many", "POST", COMP, {"model": MODEL, "prompt": "x", "logprobs": 9}, 400, "logprobs",
     None),
    ("unknown model completions", "POST", COMP, {"model": "x", "prompt": "x"}, 404, "model", "model_not_found"),
    ("tool without a name", "POST", CHAT, chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400,
     "tools[0].function.name", "missing_required_parameter"),
    ("tool schema not JSON Schema", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt", "properties": 5}}}]), 400, "tools[0].function.parameters", None),
    ("tool_choice names a missing function", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                                 tool_choice={"type": "function",
                                                                              "function": {"name": "g"}}),
     400, "tool_choice", None),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice", None),
    ("json_schema without a schema", "POST", CHAT, chat(response_format={"type": "json_schema",
                                                                          "json_schema": {"name": "x"}}),
     400, "response_format.json_schema.schema", "missing_required_parameter"),
    ("json_schema not JSON Schema", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 12}}}), 400, "response_format.json_schema.schema", None),
    ("response_format unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format",
     None),
    ("tool schema $schema not a string", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"$schema": [], "type": "object"}}}]), 400, "tools[0].function.parameters", None),
    ("tool schema x-guidance not an object", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"x-guidance": 1, "type": "object"}}}]), 400, "tools[0].function.parameters", None),
    ("json_schema x-guidance not an object", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "x-guidance": 1}}}), 400, "response_format.json_schema.schema", None),
    ("json_schema $schema not a string", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "$schema": {}}}}), 400, "response_format.json_schema.schema", None),
    ("tool schema 40 objects deep", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": DEEP}}]), 400, "tools[0].function.parameters", None),
    ("json_schema 40 objects deep", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP}}), 400, "response_format.json_schema.schema", None),
    ("json_schema 100 objects deep", "POST", CHAT, json.dumps(chat(response_format={"type": "json_schema",
        "json_schema": {"name": "x", "schema": _nested(100)}})).encode(), 400, None, "invalid_json"),
    ("auto with a non-text part whose text is a number", "POST", CHAT, chat(model="auto", messages=[
        {"role": "user", "content": [{"type": "image_url", "text": 5}]}]), 400, "messages[0].content", None),
    ("tool call arguments nested 100000 deep", "POST", CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": "[" * 100000}}]},
        {"role": "tool", "tool_call_id": "1", "content": "x"}]), 400, "messages", "context_length_exceeded"),
    # bench/fuzz.py found it (issue 54): llguidance cannot write an integer past 64 bits as JSON
    ("json_schema with an integer past 64 bits", "POST", CHAT, chat(response_format={"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "integer", "maximum": 10**20}}}), 400,
     "response_format.json_schema.schema", None),
    ("tool message without tool_call_id", "POST", CHAT, chat(messages=[{"role": "user", "content": "hi"},
                                                                      {"role": "tool", "content": "x"}]),
     400, "messages[1].tool_call_id", None),
    ("unknown model card", "GET", "/v1/models/nope", None, 404, "model", "model_not_found"),
    ("unknown route", "GET", "/v1/nothing", None, 404, None, None),
    ("wrong method", "GET", CHAT, None, 405, None, None),
]


def check_shape(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, case):
    name, method, path, body, status, param, code = case
    content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    r = httpx.request(method, server.base_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=30)
    assert r.status_code == status, r.text
    err = check_shape(r)
    if status < 500:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    # ... and the server still answers a good request.
    ok = httpx.post(server.base_url + CHAT, json=chat(max_tokens=2), timeout=60)
    assert ok.status_code == 200


def test_context_message_names_the_limit(server):
    r = httpx.post(server.base_url + CHAT, json=chat(max_tokens=10**6), timeout=30)
    assert "maximum context length is 2048 tokens" in r.json()["error"]["message"]


def test_oversized_body_413(server):
    big = chat(messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])
    r = httpx.post(server.base_url + CHAT, json=big, timeout=30)
    assert r.status_code == 413 and check_shape(r)["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(6):
            yield b"y" * (1024 * 1024)
        yield b'"}]}'

    r = httpx.post(server.base_url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert httpx.post(server.base_url + CHAT, json=chat(max_tokens=2), timeout=60).status_code == 200


@pytest.fixture(scope="module")
def keyed(smollm):
    s = start_server(smollm, api_keys=["sk-one", "sk-two"], max_running=2)
    yield s
    s.stop()


@pytest.mark.parametrize("header", [None, "Bearer wrong", "sk-one", "Basic sk-one", "Bearer s\u00e9cret".encode()])
def test_auth_401(keyed, header):
    headers = {"authorization": header} if header else {}
    r = httpx.post(keyed.base_url + CHAT, json=chat(max_tokens=2), headers=headers, timeout=30)
    assert r.status_code == 401 and check_shape(r)["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(keyed.base_url + "/v1/models", headers=headers).status_code == 401


def test_auth_ok_with_sdk(keyed):
    from openai import AuthenticationError, OpenAI

    for key in ("sk-one", "sk-two"):
        c = OpenAI(base_url=keyed.base_url + "/v1", api_key=key, max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=OK_MSG, max_tokens=2).choices
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=keyed.base_url + "/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(keyed.base_url + "/health").status_code == 200  # health needs no key


def test_sdk_maps_errors(client):
    from openai import BadRequestError, NotFoundError

    with pytest.raises(NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=OK_MSG)
    assert e.value.code == "model_not_found"
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=OK_MSG, temperature=9)
    assert e.value.param == "temperature"


def test_extreme_repetition_penalty_fails_no_one(server):
    """repetition_penalty 1e-300 is in range (above 0, as vLLM allows): it answers, and so does the
    request decoding beside it (it used to fail the step, and with it every running request)."""
    import threading

    results: dict[str, httpx.Response] = {}

    def ask(name: str, **kw) -> None:
        results[name] = httpx.post(server.base_url + CHAT, json=chat(max_tokens=12, ignore_eos=True, **kw), timeout=60)

    threads = [threading.Thread(target=ask, args=("bad",), kwargs={"repetition_penalty": 1e-300, "temperature": 0.7}),
               threading.Thread(target=ask, args=("good",), kwargs={"temperature": 0.7})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("bad", "good"):
        r = results[name]
        assert r.status_code == 200, (name, r.text)
        assert r.json()["usage"]["completion_tokens"] == 12


def test_escaped_surrogate_pair_is_a_character(server):
    """An emoji escaped as a UTF-16 pair (json.dumps does so by default) is valid and answered."""
    body = json.dumps(chat(max_tokens=2, messages=[{"role": "user", "content": "hi \U0001F600"}]))
    assert "\\ud83d\\ude00" in body
    r = httpx.post(server.base_url + CHAT, content=body.encode(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_api_keys_from_flag_environment_and_file(tmp_path):
    from wafer.router.config import ConfigError
    from wafer.server.main import api_keys

    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    assert api_keys(["sk-flag"], str(f), {"WAFER_API_KEY": "sk-env-1, sk-env-2"}) == [
        "sk-flag", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"]
    assert api_keys([], None, {}) == []
    # A blank key would leave the server open without a word: refused, wherever it comes from.
    for given, env in (([""], {}), (["  "], {}), (["sk-1", ""], {}), ([], {"WAFER_API_KEY": ""}),
                       ([], {"WAFER_API_KEY": "sk-1,,sk-2"})):
        with pytest.raises(ConfigError, match="empty"):
            api_keys(given, None, env)
    with pytest.raises(ConfigError, match="no such file|No such file"):
        api_keys([], str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no key"):
        api_keys([], str(tmp_path / "empty"), {})


def _two_requests_on_one_connection(base_url: str, path: str, body: bytes) -> list[bytes]:
    """Send the same POST twice on one keep-alive connection; the raw replies (a client library
    would hide a closed connection by opening another)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(base_url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    replies = []
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        f = s.makefile("rb")
        for _ in range(2):
            s.sendall(head + body)
            status = f.readline()
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            replies.append(status + f.read(int(headers.get("content-length", 0))))
    return replies


def test_unexpected_failure_is_a_500_that_keeps_the_connection(server, monkeypatch):
    from wafer.server.chat import ChatHandler

    async def broken(self, req, request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ChatHandler, "chat", broken)
    first, second = _two_requests_on_one_connection(server.base_url, CHAT, json.dumps(chat(max_tokens=1)).encode())
    for reply in (first, second):  # the second would find the connection closed (an empty read)
        assert reply.startswith(b"HTTP/1.1 500"), reply[:200]
        err = json.loads(reply.split(b"\r\n", 1)[1])["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error"


@pytest.mark.parametrize("failure", [RuntimeError("a bug"), server_error("A failure with no id.")],
                         ids=["unhandled", "api-error"])
def test_a_500_names_its_request_id(server, monkeypatch, failure):
    """The id is in the message and in `x-request-id`, as OpenAI's are: what the log names the failure by."""
    from wafer.server.chat import ChatHandler

    async def broken(self, req, request):
        raise failure

    monkeypatch.setattr(ChatHandler, "chat", broken)
    r = httpx.post(server.base_url + CHAT, json=chat(max_tokens=1), timeout=30)
    assert r.status_code == 500
    err = check_shape(r)
    rid = r.headers.get("x-request-id")
    assert rid and rid.startswith("req_") and f"(request id {rid})" in err["message"], (r.headers, err)


def test_openapi_describes_the_request_bodies(server):
    import jsonschema

    doc = httpx.get(server.base_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path, good, bad in [(CHAT, chat(max_tokens=2, temperature=0.5), chat(temperature="hot")),
                            (COMP, {"model": MODEL, "prompt": ["a", "b"]}, {"model": MODEL, "prompt": {"a": 1}})]:
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert set(op["responses"]) == {"200", "400", "404", "413", "429", "500", "503"}
        # The document's schema accepts what the server accepts and refuses what it refuses.
        resolver = {**schema, "components": doc["components"]}
        jsonschema.validate(good, resolver)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, resolver)
        assert httpx.post(server.base_url + path, json=bad, timeout=30).status_code == 400
    for ops in doc["paths"].values():
        for op in ops.values():
            assert "422" not in op["responses"]


def test_metrics_open_by_default_and_protected_on_request(smollm, server):
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    s = start_server(smollm, api_keys=["sk-m"], max_running=1, protect_metrics=True)
    try:
        for path in ("/metrics", "/dashboard/data"):
            r = httpx.get(s.base_url + path)
            assert r.status_code == 401 and check_shape(r)["code"] == "invalid_api_key"
            assert httpx.get(s.base_url + path, headers={"authorization": "Bearer sk-m"}).status_code == 200
        doc = httpx.get(s.base_url + "/openapi.json").json()
        assert doc["paths"][CHAT]["post"]["security"] == [{"bearer": []}]
        assert httpx.get(s.base_url + "/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("path, body", [
    (CHAT, chat(messages=[{"role": "user", "content": "\n" * 1_500_000}])),
    (COMP, {"model": MODEL, "prompt": "ab " * 500_000}),
], ids=["chat", "completions"])
def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(server, path, body):
    """Megabytes of text would take seconds to tokenize only to be refused: a text longer than the
    context times the longest token's text is refused at once."""
    import time

    start = time.perf_counter()
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    took = time.perf_counter() - start
    assert r.status_code == 400 and check_shape(r)["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"], "it was tokenized"
    assert took < 10
