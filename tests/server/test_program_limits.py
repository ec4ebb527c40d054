"""Model-written programs' limits set by the operator: `wafer serve`'s flags over wafer.toml's
[sandbox] table over the defaults. A real `wafer serve` process whose programs come from a scripted
upstream model, driven with the `openai` SDK; bad values stop the server at start."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tests.agents.scripted import ScriptedChat
from tests.serving import free_port, serve_process, wait_healthy
from wafer.agents import cgroup
from wafer.agents.sandbox import check_sandbox
from wafer.cli import main

MiB = 2**20
TOOLS = [
    {"type": "programmatic_tool_calling"},
    {"type": "function", "name": "get_price", "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}},
     "allowed_callers": ["programmatic"]},
]
# Holds memfds (outside the address space: only the memory cgroup stops them), 10 MiB each, up to 256 MiB.
MEMFD_BOMB = """
import os
chunk = b'x' * 2**20
fds = []
for _ in range(26):
    fd = os.memfd_create('hold')
    for _ in range(10):
        os.write(fd, chunk)
    fds.append(fd)
text('held 256 MiB')
"""
SLEEPS = "import time\ntime.sleep(4)\ntext('slept')"


def program_turns(body):
    """Each response's first turn runs the program its input holds; the turn after ends it."""
    last = body["messages"][-1]
    return [("run_program", {"code": last["content"]})] if last["role"] == "user" else "Done."


def scripted_upstream(script: ScriptedChat) -> FastAPI:
    """An OpenAI-compatible chat model whose streamed turns are the script's."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()

        async def events():
            async for chunk in script.stream(body):
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def upstream():
    script = ScriptedChat([], policy=program_turns)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(scripted_upstream(script), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_healthy(f"http://127.0.0.1:{port}", 30)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(upstream, tiny_dir, tmp_path_factory):
    """`wafer serve` with wafer.toml's [sandbox] (one program at a time, 512 MiB each) and
    --program-memory 64MiB, which is over the file's memory_bytes."""
    if check_sandbox() is not None:
        pytest.skip(f"no sandbox here: {check_sandbox()}")
    base = upstream
    where = tmp_path_factory.mktemp("limits")
    toml = where / "wafer.toml"
    toml.write_text(f"""
[models.local]
path = "{tiny_dir}"
quant = "f32"
max_model_len = 256

[upstreams.scripted]
base_url = "{base}"
model = "scripted"

[sandbox]
memory_bytes = "512MiB"
max_running = 1
""")
    port = free_port()
    argv = [sys.executable, "-m", "wafer.cli", "serve", "--config", str(toml), "--port", str(port),
            "--state-db", str(where / "state.db"), "--program-memory", "64MiB"]
    with serve_process(argv, port, where / "serve.log", 120) as proc:
        # the start-up line says the limits the server runs with
        assert "each 64 MiB, 10 s CPU, 30 s; 1 running at once" in (where / "serve.log").read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        yield client, proc.pid


def program_output(r):
    return next(i for i in r.output if i.type == "program_output")


def test_the_program_memory_flag_bounds_a_programs_memory(served):
    client, _ = served
    out = program_output(client.responses.create(model="scripted", input=MEMFD_BOMB, tools=TOOLS))
    assert out.status == "incomplete" and "held" not in out.result, out.model_extra
    # the flag's 64 MiB, not the file's 512 MiB nor the default
    assert f"memory limit ({64 * MiB} bytes) reached" in out.model_extra["error"], out.model_extra


def programs_of(pid: int) -> list[Path]:
    """The memory cgroups of the programs that the server process `pid` runs now."""
    return list(cgroup.find().parent.glob(f"{cgroup.PREFIX}{pid}-*"))


def test_max_running_in_wafer_toml_refuses_a_second_program_with_429(served):
    client, pid = served
    deadline = time.monotonic() + 30
    while programs_of(pid) and time.monotonic() < deadline:  # an earlier test's program is gone
        time.sleep(0.02)
    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(client.responses.create, model="scripted", input=SLEEPS, tools=TOOLS)
        deadline = time.monotonic() + 30
        while not programs_of(pid) and time.monotonic() < deadline:  # until the first program runs (4 s)
            time.sleep(0.02)
        assert programs_of(pid), "the first program did not start"
        with pytest.raises(openai.RateLimitError) as e:
            client.responses.create(model="scripted", input="text('second')", tools=TOOLS)
        assert e.value.body["code"] == "programs_busy" and e.value.response.headers["retry-after"] == "1"
        out = program_output(first.result(timeout=60))
    assert out.status == "completed" and out.result == "slept\n", out.model_extra


def refused_at_start(argv: list[str], monkeypatch, capsys) -> str:
    """What `wafer serve ARGV` said as it stopped with status 2 before any model loaded (one that got
    past its checks would load none and fail, never serve)."""
    import wafer.server.main as server_main

    loaded = []
    monkeypatch.setattr(server_main, "load_models", lambda *a, **k: loaded.append(1) or [])
    assert main(["serve", *argv]) == 2 and not loaded
    return capsys.readouterr().err


@pytest.mark.parametrize("table,words", [
    ("memory_bytes = '16MiB'", "[sandbox] memory_bytes must be a size, e.g. 256MiB or 1GiB, or bytes, at least 32MiB"),
    ("max_running = 0", "[sandbox] max_running must be a whole number, more than 0, not 0"),
    ("cpu_seconds = -1", "[sandbox] cpu_seconds must be a number of seconds, more than 0, not -1"),
    ("max_parked = -1", "[sandbox] max_parked must be a whole number, 0 or more"),
    ("memory = '1GiB'", "[sandbox] has no option(s) ['memory']"),
])
def test_bad_sandbox_settings_in_wafer_toml_stop_the_server_at_start(tiny_dir, tmp_path, monkeypatch, capsys, table,
                                                                     words):
    toml = tmp_path / "wafer.toml"
    toml.write_text(f"[models.a]\npath = '{tiny_dir}'\n[sandbox]\n{table}\n")
    assert words in refused_at_start(["--config", str(toml)], monkeypatch, capsys)


@pytest.mark.parametrize("flag,value,words", [
    ("--program-memory", "16MiB", "--program-memory must be a size, e.g. 256MiB or 1GiB, or bytes, at least 32MiB"),
    ("--program-memory", "lots", "--program-memory must be a size"),
    ("--program-cpu-seconds", "0", "--program-cpu-seconds must be a number of seconds, more than 0, not '0'"),
    ("--program-wall-seconds", "-3", "--program-wall-seconds must be a number of seconds, more than 0"),
    ("--max-running-programs", "0", "--max-running-programs must be a whole number, more than 0"),
    ("--max-parked-programs", "1.5", "--max-parked-programs must be a whole number, 0 or more"),
    ("--parked-programs-memory", "-1GiB", "--parked-programs-memory must be a size"),
])
def test_bad_sandbox_flags_stop_the_server_at_start(tiny_dir, monkeypatch, capsys, flag, value, words):
    assert words in refused_at_start([str(tiny_dir), "--quant", "f32", f"{flag}={value}"], monkeypatch, capsys)
