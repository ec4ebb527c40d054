"""Programmatic tool calling through `/v1/responses`, on a scripted model, with the `openai` SDK as
the client: programs that call the client's tools pause and resume, several calls made together
come back together, and every way a program can fail ends as an incomplete `program_output`, never
an HTTP error."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.agents.drive import PROBE_FDS, only_its_pipes
from tests.agents.scripted import ScriptedChat
from tests.serving import start_server
from wafer.agents import cgroup
from wafer.agents.ptc import ProgramPool
from wafer.agents.responses import ResponsesService
from wafer.agents.sandbox import Limits, check_sandbox
from wafer.agents.store import ResponseStore

pytestmark = pytest.mark.skipif(check_sandbox() is not None, reason=f"no sandbox here: {check_sandbox()}")

MODEL = "SmolLM2-135M-Instruct"
STOCK = {"a": 3, "b": 5, "c": 7}
PRICE = {"a": 1.5, "b": 2.25}
TOOLS = [
    {"type": "programmatic_tool_calling"},
    {"type": "function", "name": "get_stock", "description": "Units in stock of a product.",
     "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"],
                    "additionalProperties": False},
     "allowed_callers": ["programmatic"]},
    {"type": "function", "name": "get_price", "description": "Price of a product.",
     "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]},
     "allowed_callers": ["direct", "programmatic"]},
]
LOOP_AND_GATHER = """
total = 0
for sku in ["a", "b", "c"]:
    reply = await get_stock(sku=sku)
    total += reply["units"]
prices = await asyncio.gather(get_price(sku="a"), get_price(sku="b"))
text(f"total={total} prices={[p['price'] for p in prices]}")
"""


@pytest.fixture(scope="module")
def ptc(smollm, tmp_path_factory):
    script = ScriptedChat([])
    pool = ProgramPool(park_seconds=60)
    service = ResponsesService(script, ResponseStore(tmp_path_factory.mktemp("state") / "state.db"), pool,
                               Limits(cpu_seconds=2, wall_seconds=4, output_bytes=4096))
    server = start_server(smollm, names=[MODEL], responses=service)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client, script, pool
    server.stop()


def run_client_tool(call) -> str:
    args = json.loads(call.arguments)
    table = STOCK if call.name == "get_stock" else PRICE
    key = "units" if call.name == "get_stock" else "price"
    return json.dumps({key: table[args["sku"]]})


def test_a_program_pauses_on_each_client_call_and_resumes(ptc):
    client, script, pool = ptc
    script.bodies.clear()
    script.turns[:] = [[("run_program", {"code": LOOP_AND_GATHER})], "There are 15 units in all."]
    r = client.responses.create(model=MODEL, input="How many units of a, b and c, and the prices of a and b?",
                                tools=TOOLS)
    program = r.output[0]
    assert program.type == "program" and "get_stock" in program.code
    batches = []
    while True:
        calls = [i for i in r.output if i.type == "function_call"]
        if not calls:
            break
        assert all(c.caller is not None and c.caller.type == "program" and c.caller.caller_id == program.call_id
                   for c in calls)
        batches.append([(c.name, json.loads(c.arguments)["sku"]) for c in calls])
        r = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, input=[
            {"type": "function_call_output", "call_id": c.call_id, "output": run_client_tool(c)} for c in calls])
    # three pauses of the loop, then the two calls of gather together
    assert batches == [[("get_stock", "a")], [("get_stock", "b")], [("get_stock", "c")],
                       [("get_price", "a"), ("get_price", "b")]]
    out = [i for i in r.output if i.type == "program_output"]
    assert len(out) == 1 and out[0].status == "completed" and out[0].call_id == program.call_id
    assert out[0].result.strip() == "total=15 prices=[1.5, 2.25]"
    assert r.output_text == "There are 15 units in all."
    # The model read the program and its output, not the calls the program made.
    second = json.dumps(script.bodies[1]["messages"])
    assert "total=15" in second and "get_stock" in second  # in the program's code
    assert not any(m.get("role") == "tool" and "units" in m["content"] for m in script.bodies[1]["messages"])
    # Only `get_price` allows a direct call; the program tool lists both.
    names = [t["function"]["name"] for t in script.bodies[0]["tools"]]
    assert names == ["get_price", "run_program"]
    assert "get_stock" in script.bodies[0]["tools"][1]["function"]["description"]
    assert not pool.parked


def test_resending_the_items_resumes_too(ptc):
    client, script, pool = ptc
    script.turns[:] = [[("run_program", {"code": "r = await get_price(sku='b')\ntext(r['price'] * 2)"})], "4.5"]
    r = client.responses.create(model=MODEL, input="Twice the price of b?", tools=TOOLS, store=False)
    call = next(i for i in r.output if i.type == "function_call")
    items = [{"role": "user", "content": "Twice the price of b?"}, *[i.model_dump(exclude_none=True) for i in r.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": run_client_tool(call)}]
    r = client.responses.create(model=MODEL, input=items, tools=TOOLS)
    out = next(i for i in r.output if i.type == "program_output")
    assert (out.status, out.result.strip()) == ("completed", "4.5")
    assert r.output_text == "4.5"


@pytest.mark.parametrize("code, why", [
    ("await get_stock(sku=5)", "5 is not of type 'string'"),
    ("await get_stock(item='a')", "'sku' is a required property"),
    ("raise ValueError('no such shelf')", "no such shelf"),
    ("while True:\n    pass", "time"),
    ("text('x' * 100_000)", "output"),
    ("def broken(:\n  pass", "SyntaxError"),
])
def test_a_failing_program_ends_incomplete_with_a_readable_error(ptc, code, why):
    client, script, _ = ptc
    script.turns[:] = [[("run_program", {"code": code})], "It did not work."]
    r = client.responses.create(model=MODEL, input="go", tools=TOOLS)
    assert r.status == "completed"
    out = next(i for i in r.output if i.type == "program_output")
    assert out.status == "incomplete"
    error = (out.model_extra or {}).get("error") or ""
    assert why.lower() in (error + out.result).lower(), (error, out.result)
    assert r.output_text == "It did not work."
    # the model was told
    assert "did not complete" in script.bodies[-1]["messages"][-1]["content"]


def test_a_schema_violation_can_be_caught_by_the_program(ptc):
    client, script, _ = ptc
    code = "try:\n    await get_stock(sku=5)\nexcept Exception as e:\n    text('caught:', type(e).__name__)"
    script.turns[:] = [[("run_program", {"code": code})], "ok"]
    r = client.responses.create(model=MODEL, input="go", tools=TOOLS)
    out = next(i for i in r.output if i.type == "program_output")
    assert out.status == "completed" and out.result.startswith("caught:"), out


def test_a_parked_program_is_freed_after_its_timeout(ptc):
    client, script, pool = ptc
    script.turns[:] = [[("run_program", {"code": "text(await get_price(sku='a'))"})], "Gone."]
    r = client.responses.create(model=MODEL, input="price of a?", tools=TOOLS)
    call = next(i for i in r.output if i.type == "function_call")
    parked = pool.parked[r.output[0].call_id]
    pool.park_seconds, parked.deadline = 0.2, time.monotonic() + 0.2
    deadline = time.monotonic() + 10
    while pool.parked and time.monotonic() < deadline:
        time.sleep(0.05)
    pool.park_seconds = 60
    assert not pool.parked
    while not parked.program.finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert parked.program.finished
    # its outputs arriving late end the program as incomplete, and the model goes on
    r = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": run_client_tool(call)}])
    out = next(i for i in r.output if i.type == "program_output")
    assert out.status == "incomplete" and "no longer running" in out.model_extra["error"]
    assert r.output_text == "Gone."


def test_deleting_the_response_frees_its_parked_program(ptc):
    client, script, pool = ptc
    script.turns[:] = [[("run_program", {"code": "text(await get_price(sku='a'))"})]]
    r = client.responses.create(model=MODEL, input="price of a?", tools=TOOLS)
    parked = pool.parked[r.output[0].call_id]
    client.responses.delete(r.id)
    assert r.output[0].call_id not in pool.parked
    deadline = time.monotonic() + 10
    while not parked.program.finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert parked.program.finished


def test_outputs_for_only_some_of_a_programs_calls_are_refused(ptc):
    client, script, pool = ptc
    script.turns[:] = [[("run_program", {"code": "await asyncio.gather(get_price(sku='a'), get_price(sku='b'))"})]]
    r = client.responses.create(model=MODEL, input="go", tools=TOOLS)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "{}"}])
    assert calls[1].call_id in e.value.body["message"]
    assert r.output[0].call_id in pool.parked  # still waiting for both
    client.responses.delete(r.id)


def test_streamed_program_turn(ptc):
    client, script, _ = ptc
    script.turns[:] = [[("run_program", {"code": "text(sum([1, 2, 3]))"})], "Six."]
    with client.responses.stream(model=MODEL, input="sum 1..3", tools=TOOLS) as stream:
        events = [e for e in stream]
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["program", "program_output", "message"]
    assert [i.type for i in final.output] == ["program", "program_output", "message"]
    assert final.output[1].result.strip() == "6"


def test_metrics_count_responses_by_mode(ptc):
    client, script, _ = ptc
    base = str(client.base_url).removesuffix("/v1/")

    def sample(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    before = httpx.get(base + "/metrics").text
    script.turns[:] = [[("run_program", {"code": "text(await get_price(sku='a'))"})]]
    r = client.responses.create(model=MODEL, input="price of a?", tools=TOOLS)
    call = next(i for i in r.output if i.type == "function_call")
    script.turns[:] = ["1.5"]
    client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": run_client_tool(call)}])
    after = httpx.get(base + "/metrics").text
    key = 'wafer:agent_responses_total{mode="programmatic",status="completed"}'
    assert sample(after, key) - sample(before, key) == 2
    key = 'wafer:agent_tool_calls_total{caller="programmatic"}'
    assert sample(after, key) - sample(before, key) == 1
    key = 'wafer:agent_model_turns_total{mode="programmatic"}'
    assert sample(after, key) - sample(before, key) == 2
    key = 'wafer:agent_seconds_total{mode="programmatic"}'
    assert sample(after, key) > sample(before, key)
    data = httpx.get(base + "/dashboard/data").json()["agents"]
    assert data["programmatic"]["responses"] >= 2 and data["programmatic"]["tokens_read"] > 0
    assert data["programmatic"]["seconds"] > 0 and data["programmatic"]["cost_usd"] == 0  # no prices here


def test_without_a_sandbox_programmatic_calling_is_refused(ptc, monkeypatch):
    import wafer.agents.responses as responses

    client, script, _ = ptc
    monkeypatch.setattr(responses, "check_sandbox", lambda: "bwrap is not installed")
    script.turns[:] = [[("run_program", {"code": "text(1)"})]]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="go", tools=TOOLS)
    assert e.value.body["code"] == "sandbox_unavailable" and "bwrap is not installed" in e.value.body["message"]
    assert script.turns  # no model turn ran, so no program could
    script.turns.clear()


# --- a server started with descriptors of its own, and bounds on programs' memory ---------------

MiB = 2**20
TIGHT = Limits(cpu_seconds=4, wall_seconds=8, memory_bytes=128 * MiB, output_bytes=64 * 1024)


def program_turns(body):
    """Every request's first turn runs the program its input holds; the turn after ends the response."""
    last = body["messages"][-1]
    return [("run_program", {"code": last["content"]})] if last["role"] == "user" else "Done."


@pytest.fixture(scope="module")
def tight(smollm, tmp_path_factory):
    """A server launched as from a careless shell, holding an inheritable host file open for writing
    and an inheritable listening socket with a connection waiting, whose programs may use 128 MiB
    each, two at once, and 200 MiB together while parked."""
    secret = tmp_path_factory.mktemp("host") / "host-file.txt"
    secret.write_text("host secret\n")
    opened = os.open(secret, os.O_RDWR | os.O_APPEND)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    waiting = socket.create_connection(listener.getsockname())
    for fd in (opened, listener.fileno()):
        os.set_inheritable(fd, True)
    pool = ProgramPool(max_running=2, parked_memory_bytes=200 * MiB, park_seconds=60)
    service = ResponsesService(ScriptedChat([], policy=program_turns),
                               ResponseStore(tmp_path_factory.mktemp("state") / "state.db"), pool, TIGHT)
    server = start_server(smollm, names=[MODEL], responses=service)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client, pool, secret, listener
    server.stop()
    waiting.close()
    listener.close()
    os.close(opened)


def program_output(r):
    return next(i for i in r.output if i.type == "program_output")


def test_a_program_sees_only_its_three_pipes_whatever_the_server_holds(tight):
    client, _, secret, listener = tight
    r = client.responses.create(model=MODEL, input=PROBE_FDS, tools=TOOLS)
    out = program_output(r)
    assert out.status == "completed", out.model_extra
    only_its_pipes(out.result)
    assert not any(line.startswith(("ACCEPTED", "READ", "WROTE")) for line in out.result.splitlines()), out.result
    assert secret.read_text() == "host secret\n"
    listener.settimeout(5)
    conn, _ = listener.accept()  # the connection that waited is still the host's to take
    conn.close()


# Holds 100 MiB, then tries for 1 GiB, in memfds: outside the address space, each file under
# RLIMIT_FSIZE, so that only the memory cgroup can stop it.
HOLD = """
import os, time
fds = []
chunk = b'x' * 2**20
def hold(mib):
    for _ in range(mib // 10):
        fd = os.memfd_create('hold')
        for _ in range(10):
            os.write(fd, chunk)
        fds.append(fd)
"""
GREEDY = HOLD + """
hold(100)
time.sleep(2)
hold(1024)
text('held 1 GiB')
"""


def cgroups_usage() -> int:
    """Bytes charged now to every program's memory cgroup of this process's servers."""
    parent = cgroup.find().parent
    total = 0
    for d in parent.glob(cgroup.PREFIX + f"{os.getpid()}-*"):
        for name in ("memory.current", "memory.usage_in_bytes"):
            try:
                total += int((d / name).read_text())
            except (OSError, ValueError):
                continue
    return total


def test_eight_greedy_programs_hold_at_most_the_servers_bound(tight):
    """Eight programs each trying to hold 1 GiB at once: two run (the others get 429 with
    Retry-After), each killed at its limit with a clear error; the memory charged to all programs
    together never goes over two programs' limits."""
    client, pool, _, _ = tight
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], cgroups_usage())
            time.sleep(0.005)

    def one(_):
        try:
            return program_output(client.responses.create(model=MODEL, input=GREEDY, tools=TOOLS))
        except openai.RateLimitError as e:
            return e

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(one, range(8)))
    finally:
        stop.set()
        sampler.join()
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    ran = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert refused and len(ran) >= 2, results
    for e in refused:
        assert e.status_code == 429 and e.body["code"] == "programs_busy" and e.response.headers["retry-after"] == "1"
    for out in ran:
        assert out.status == "incomplete" and "held" not in out.result
        assert f"memory limit ({TIGHT.memory_bytes} bytes) reached" in out.model_extra["error"], out.model_extra
    assert 100 * MiB < peak[0] <= pool.max_running * TIGHT.memory_bytes, peak[0]
    assert pool.running == 0 and not pool.programs


PARKS = HOLD + """
hold(90)
text(await get_price(sku='a'))
hold(10)
text('grew to 100 MiB')
"""


def test_parked_programs_hold_at_most_the_parked_memory(tight):
    """A parked program keeps what it holds, counted against the server's parked memory: the first
    parks with about 100 MiB, the second would take the total over 200 MiB and ends with an error."""
    client, pool, _, _ = tight
    first = client.responses.create(model=MODEL, input=PARKS, tools=TOOLS)
    assert [i.type for i in first.output] == ["program", "function_call"]
    held = pool.parked_bytes
    assert 90 * MiB < held <= TIGHT.memory_bytes
    second = client.responses.create(model=MODEL, input=PARKS, tools=TOOLS)
    out = program_output(second)
    assert out.status == "incomplete" and "waiting on this server would hold more than 209715200 bytes" in \
        out.model_extra["error"], out.model_extra
    # the parked program grows no further while it waits: its cgroup's limit is what it held
    parked = next(iter(pool.parked.values())).program
    assert parked.memory_peak <= held
    # resuming it needs a running slot: without one it waits, holding what it held while parked
    call = next(i for i in first.output if i.type == "function_call")
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": run_client_tool(call)}]
    pool.max_running = 0
    with ThreadPoolExecutor(1) as ex:
        resumed = ex.submit(client.responses.create, model=MODEL, previous_response_id=first.id, tools=TOOLS,
                            input=outputs)
        time.sleep(1.5)
        assert not resumed.done() and parked.holds == "parked" and pool.parked_bytes == held
        pool.max_running = 2
        r = resumed.result(timeout=30)
    # and it runs with its whole limit again
    out = program_output(r)
    assert out.status == "completed", out.model_extra
    assert out.result.splitlines() == ["{'price': 1.5}", "grew to 100 MiB"]
    assert pool.parked_bytes == 0 and not pool.parked
