"""The Batch API with the official `openai` SDK: files, a batch of 200 lines (some bad) with its
output and error files, the other endpoints, cancelling, a restart in the middle of a batch, and
another tenant's files and batches not found. On a tiny random model (tests/tiny.py: SmolLM2's
tokenizer and chat template, two small layers), greedy, a token or a few a line: what is tested is
the API and the bookkeeping, and 200 lines of the bundled model cost several times as much."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from tests.serving import start_server
from wafer.server.batch_store import BatchStore

MODEL = "tiny"
FILE_LIMIT = 100_000  # bytes: the module's server takes files up to this (--max-file-bytes)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from wafer.models.loader import load_model

    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def batch_server(tiny, tmp_path_factory):
    db = tmp_path_factory.mktemp("state") / "state.db"
    server = start_server(tiny, names=[MODEL], state_db=db, max_file_bytes=FILE_LIMIT)
    yield server, _client(server), db
    server.stop()


def chat_line(custom_id: str, text: str, max_tokens: int = 1, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, content: bytes, name: str = "in.jsonl"):
    return client.files.create(file=(name, io.BytesIO(content)), purpose="batch")


def wait_for(client: openai.OpenAI, bid: str, until, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(bid)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch {bid} still {b.status} {b.request_counts} after {timeout} s"
        time.sleep(0.25)


def final(b) -> bool:
    return b.status in ("completed", "failed", "cancelled", "expired")


def read_jsonl(client: openai.OpenAI, fid: str | None) -> list[dict]:
    if fid is None:
        return []
    return [json.loads(line) for line in client.files.content(fid).text.splitlines()]


# --- files ---------------------------------------------------------------------------------------

def test_files_are_uploaded_listed_read_and_deleted(batch_server):
    _, client, _ = batch_server
    content = jsonl([chat_line("a", "Hi")])
    f = upload(client, content, "mine.jsonl")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch"
    assert f.bytes == len(content) and f.filename == "mine.jsonl"
    assert client.files.retrieve(f.id).bytes == len(content)
    assert client.files.content(f.id).content == content
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(f.id)


def test_a_file_over_the_limit_or_of_another_purpose_is_refused(batch_server):
    server, client, _ = batch_server
    with pytest.raises(openai.APIStatusError) as e:
        upload(client, b"x" * (FILE_LIMIT + 1))
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=upload(client, b"{}\n").id, endpoint="/v1/embeddings",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    paths = httpx.get(server.base_url + "/openapi.json").json()["paths"]  # each error status is documented
    assert {"400", "413"} <= set(paths["/v1/files"]["post"]["responses"])
    assert {"404", "409"} <= set(paths["/v1/batches/{batch_id}/cancel"]["post"]["responses"])


def test_another_tenants_files_and_batches_are_not_found(batch_server):
    """Rows belong to the tenant of the key that made them: one made for another tenant is not
    found, listed, read, deleted, run or cancelled by this (keyless) one."""
    _, client, db = batch_server
    store = BatchStore(db)
    store.put_file("file-theirs", "team-b", "t.jsonl", "batch", jsonl([chat_line("a", "Hi")]))
    batch = {"id": "batch_theirs", "object": "batch", "created_at": int(time.time()), "status": "completed",
             "endpoint": "/v1/chat/completions"}
    store.put_batch(batch, "team-b", [])
    for call in (lambda: client.files.retrieve("file-theirs"), lambda: client.files.content("file-theirs"),
                 lambda: client.files.delete("file-theirs"), lambda: client.batches.retrieve("batch_theirs"),
                 lambda: client.batches.cancel("batch_theirs"),
                 lambda: client.batches.create(input_file_id="file-theirs", endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert "file-theirs" not in [f.id for f in client.files.list()]
    assert "batch_theirs" not in [b.id for b in client.batches.list()]
    assert store.file("file-theirs", "team-b") is not None  # still there for its owner
    store.close()


# --- batches -------------------------------------------------------------------------------------

def test_a_batch_of_200_lines_with_bad_ones_writes_its_output_and_error_files(batch_server):
    server, client, _ = batch_server
    good = [chat_line(f"q{i}", f"{i}?") for i in range(192)]
    bad = [
        "{not json",                                                           # not JSON
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),  # no custom_id
        json.dumps(chat_line("q0", "again")),                                 # q0 twice
        json.dumps({**chat_line("wrong-url", "Hi"), "url": "/v1/completions"}),  # not the batch's endpoint
        json.dumps({**chat_line("no-body", "Hi"), "body": "text"}),           # body not an object
        json.dumps(chat_line("bad-param", "Hi", max_tokens=-1)),              # the endpoint's 400
        json.dumps(chat_line("bad-model", "Hi") | {"body": {**chat_line("x", "Hi")["body"], "model": "nope"}}),  # 404
        json.dumps(chat_line("bad-temp", "Hi", temperature=9)),               # the endpoint's 400
    ]
    lines = good[:100] + bad + good[100:]
    assert len(lines) == 200
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "numbers"})
    assert b.id.startswith("batch_") and b.status in ("validating", "in_progress") and b.metadata == {"job": "numbers"}
    b = wait_for(client, b.id, final)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (200, 192, 8)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.expires_at > b.created_at
    assert b.usage.output_tokens == 192 and b.usage.input_tokens > 192 * 10

    out = read_jsonl(client, b.output_file_id)
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(192)]  # in the input's order
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"]
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 1
    # The right answer: a line's is what the same request gets interactively (greedy).
    direct = client.chat.completions.create(**good[7]["body"])
    assert out[7]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content

    errors = {e["custom_id"]: e for e in read_jsonl(client, b.error_file_id)}
    assert len(read_jsonl(client, b.error_file_id)) == 8
    unnamed = [e for e in read_jsonl(client, b.error_file_id) if e["custom_id"] is None]
    assert sorted(e["error"]["code"] for e in unnamed) == ["invalid_json_line", "missing_required_parameter"]
    assert errors["q0"]["error"]["code"] == "duplicate_custom_id"
    assert errors["wrong-url"]["error"]["code"] == "mismatched_url"
    assert errors["no-body"]["error"]["code"] == "invalid_request"
    for cid, status in (("bad-param", 400), ("bad-model", 404), ("bad-temp", 400)):
        e = errors[cid]
        assert e["error"] is None and e["response"]["status_code"] == status, e
        assert e["response"]["body"]["error"]["message"]
    assert all(e["response"] is None for e in unnamed)
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    assert b.id in [x.id for x in client.batches.list(limit=100)]
    server.wait_idle()


def test_completions_and_responses_batches(batch_server):
    server, client, _ = batch_server
    comp = upload(client, jsonl([{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": MODEL, "prompt": f"{i} plus {i} is", "max_tokens": 2,
                                           "temperature": 0}} for i in range(2)]))
    resp = upload(client, jsonl([{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                                  "body": {"model": MODEL, "input": f"Say {i}.", "max_output_tokens": 3,
                                           "temperature": 0}} for i in range(2)]))
    a = client.batches.create(input_file_id=comp.id, endpoint="/v1/completions", completion_window="24h")
    b = client.batches.create(input_file_id=resp.id, endpoint="/v1/responses", completion_window="24h")
    a, b = wait_for(client, a.id, final), wait_for(client, b.id, final)
    assert a.status == b.status == "completed" and a.request_counts.completed == b.request_counts.completed == 2
    assert [o["response"]["body"]["object"] for o in read_jsonl(client, a.output_file_id)] == ["text_completion"] * 2
    responses = read_jsonl(client, b.output_file_id)
    assert [o["response"]["body"]["object"] for o in responses] == ["response"] * 2
    assert client.responses.retrieve(responses[0]["response"]["body"]["id"]).output_text  # stored, as any
    assert a.error_file_id is None and b.error_file_id is None


def test_a_batch_can_be_cancelled(batch_server):
    server, client, _ = batch_server
    f = upload(client, jsonl([chat_line(f"long{i}", "Tell me a long story.", max_tokens=200, ignore_eos=True)
                              for i in range(40)]))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    b = wait_for(client, b.id, final, timeout=30)
    assert b.status == "cancelled" and b.cancelling_at and b.cancelled_at
    assert b.request_counts.completed < 40
    assert len(read_jsonl(client, b.output_file_id)) == b.request_counts.completed
    server.wait_idle(10)  # its running lines were aborted
    with pytest.raises(openai.APIStatusError) as e:  # a batch that ended cannot be cancelled
        client.batches.cancel(wait_for(client, client.batches.create(
            input_file_id=upload(client, jsonl([chat_line("one", "Hi")])).id, endpoint="/v1/chat/completions",
            completion_window="24h").id, final).id)
    assert e.value.status_code == 409


def test_a_batch_resumes_after_a_restart_and_lines_done_stay_done(tiny, tmp_path):
    db = tmp_path / "state.db"
    lines = [chat_line(f"r{i}", f"Count to {i}.", max_tokens=24, ignore_eos=True) for i in range(48)]
    first = start_server(tiny, names=[MODEL], state_db=db, max_running=4)
    try:
        client = _client(first)
        b = client.batches.create(input_file_id=upload(client, jsonl(lines)).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        wait_for(client, b.id, lambda x: x.request_counts.completed >= 4)
    finally:
        first.stop()  # mid-batch: its running lines are aborted and keep no result
    store = BatchStore(db)
    before = store.results(b.id)[0].decode().splitlines()
    pending = store.pending(b.id)
    store.close()
    assert 4 <= len(before) < 48 and len(before) + len(pending) == 48

    second = start_server(tiny, names=[MODEL], state_db=db)
    try:
        client = _client(second)
        done = wait_for(client, b.id, final)
        assert done.status == "completed" and done.request_counts.completed == 48
        out = client.files.content(done.output_file_id).text.splitlines()
        assert sorted(json.loads(o)["custom_id"] for o in out) == sorted(f"r{i}" for i in range(48))
        assert set(before) <= set(out)  # the lines done before, as they were
        # The second server ran only the lines left (beside its warm-up's few tokens).
        assert 0 <= second.engine.stats.generated_tokens - len(pending) * 24 < 24
    finally:
        second.stop()
