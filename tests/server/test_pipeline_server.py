"""`wafer serve --pipeline-parallel 2` as a user runs it, through the openai SDK: answers (tools
included) equal the single-process server's; a stage killed mid-stream ends the stream with an
error event, /health shows the fault, the stages come back and a new request succeeds; stopping
the server leaves no stage process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving import MODEL, free_port, wait_healthy

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def pp_server(smollm):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "wafer.cli", "serve", str(smollm.path),
                             "--served-model-name", MODEL, "--port", str(port), "--pipeline-parallel", "2"],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 180)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _pipeline(base: str) -> dict:
    return httpx.get(base + "/health", timeout=5).json()["pipelines"][MODEL]


def _ask(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, **kw)


def test_answers_equal_the_single_process_server(pp_server, client):
    base, _ = pp_server
    pp = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    assert _pipeline(base)["stages"] == 2
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "Write a haiku about the sea."}]):
        want = _ask(client, messages=messages)
        got = _ask(pp, messages=messages)
        assert got.choices[0].message.content == want.choices[0].message.content
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    want = _ask(client, messages=messages, tools=TOOLS, tool_choice="required")
    got = _ask(pp, messages=messages, tools=TOOLS, tool_choice="required")
    assert got.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert got.choices[0].message.tool_calls[0].function.arguments == want.choices[0].message.tool_calls[0].function.arguments
    again = _ask(pp, messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_killed_stage_ends_stream_then_recovers(pp_server):
    base, proc = pp_server
    pp = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    info = _pipeline(base)
    restarts, (pid,) = info["restarts"], info["stage_pids"]
    stream = pp.chat.completions.create(model=MODEL, stream=True, max_tokens=2000, temperature=0,
                                        extra_body={"ignore_eos": True},
                                        messages=[{"role": "user", "content": "Count from one to a thousand."}])
    received = 0
    with pytest.raises(openai.APIError) as failure:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 5:
                    os.kill(pid, signal.SIGKILL)
    assert received >= 5
    assert "unavailable" in str(failure.value.message)
    health = httpx.get(base + "/health", timeout=5)
    if health.status_code == 503:  # (the stages may already be back)
        assert health.json()["status"] == "fault" and health.json()["faults"]
    wait_healthy(base, 120)
    info = _pipeline(base)
    assert info["restarts"] == restarts + 1 and info["stage_pids"] != [pid]
    reply = _ask(pp, messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content
    pids = info["stage_pids"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids + [pid]):
        assert time.monotonic() < deadline, "a stage process outlived the server"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
