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

pytestmark = pytest.mark.heavy

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


CLIENT = """
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0)
r = c.chat.completions.create(model=sys.argv[2], temperature=0, max_tokens=40,
                              messages=[{"role": "user", "content": "What is the capital of France?"}])
print(json.dumps({"content": r.choices[0].message.content}))
"""


def _netns(name: str) -> bool:
    return subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0


def test_two_nodes_under_torchrun(smollm, client, tmp_path):
    """Two torchrun launches with --nnodes 2, each in a network namespace of its own joined by a veth
    pair (loopback where namespaces cannot be made): rank 0 serves HTTP, rank 1 is the second stage."""
    tag = f"{os.getpid() % 10000}"
    ns = [f"wafer-a{tag}", f"wafer-b{tag}"]
    isolated = _netns(ns[0]) and _netns(ns[1])
    if isolated:
        for cmd in (["ip", "link", "add", f"wv0{tag}", "netns", ns[0], "type", "veth", "peer", "name", f"wv1{tag}",
                     "netns", ns[1]],
                    ["ip", "-n", ns[0], "addr", "add", "10.77.0.1/24", "dev", f"wv0{tag}"],
                    ["ip", "-n", ns[1], "addr", "add", "10.77.0.2/24", "dev", f"wv1{tag}"],
                    ["ip", "-n", ns[0], "link", "set", f"wv0{tag}", "up"], ["ip", "-n", ns[1], "link", "set", f"wv1{tag}", "up"],
                    ["ip", "-n", ns[0], "link", "set", "lo", "up"], ["ip", "-n", ns[1], "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        master = "10.77.0.1"
        prefix = [["ip", "netns", "exec", ns[0]], ["ip", "netns", "exec", ns[1]]]
        ifnames = [f"wv0{tag}", f"wv1{tag}"]
    else:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        master, prefix, ifnames = "127.0.0.1", [[], []], ["lo", "lo"]
    port, http = free_port(), free_port()
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", master, "--master-port", str(port)]
    launches = [[*torchrun, "--node-rank", "0", "-m", "wafer.cli", "serve", str(smollm.path), "--served-model-name",
                 MODEL, "--host", master, "--port", str(http)],
                [*torchrun, "--node-rank", "1", "-m", "wafer.engine.pipeline"]]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen([*prefix[i], "env", f"GLOO_SOCKET_IFNAME={ifnames[i]}", *launches[i]],
                              cwd=Path(__file__).resolve().parents[2], stdout=logs[i], stderr=subprocess.STDOUT,
                              start_new_session=True) for i in range(2)]
    base = f"http://{master}:{http}"
    try:
        ask = [*prefix[0], sys.executable, "-c", CLIENT, base + "/v1", MODEL]
        deadline, answer = time.monotonic() + 240, None
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            health = subprocess.run([*prefix[0], sys.executable, "-c",
                                     f"import httpx; print(httpx.get('{base}/health', timeout=2).status_code)"],
                                    capture_output=True, text=True)
            if health.stdout.strip() == "200":
                answer = subprocess.run(ask, capture_output=True, text=True, timeout=120)
                break
            time.sleep(1)
        assert answer is not None and answer.returncode == 0, \
            (answer.stderr if answer else "") + "".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2))
        import json

        want = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert json.loads(answer.stdout)["content"] == want.choices[0].message.content
        if isolated:  # the steps went over the veth pair: the prompt's hidden states alone are 90 KB,
            # and each greedy token comes back (as a token: every row is greedy)
            stats = subprocess.run(["ip", "-n", ns[0], "-j", "-s", "link", "show", ifnames[0]], capture_output=True,
                                   text=True, check=True)
            counters = json.loads(stats.stdout)[0]["stats64"]
            assert counters["tx"]["bytes"] > 90_000 and counters["rx"]["bytes"] > 40 * 50, counters
        # The second machine's stage dies: the server stays up and says so, and a stage started again
        # by hand (the environment torchrun gave the first) is taken in.
        for pid in _descendants(procs[1].pid):  # torchrun's agent and the rank it started
            os.kill(pid, signal.SIGKILL)
        procs[1].wait(10)
        assert json.loads(subprocess.run(ask, capture_output=True, text=True, timeout=120).stdout or "{}") == {}
        health = subprocess.run([*prefix[0], sys.executable, "-c",
                                 f"import httpx; r = httpx.get('{base}/health', timeout=2); print(r.status_code, r.json()['faults'])"],
                                capture_output=True, text=True)
        assert health.stdout.startswith("503") and "stage" in health.stdout, health.stdout + health.stderr
        env = [f"RANK=1", "WORLD_SIZE=2", f"MASTER_ADDR={master}", f"MASTER_PORT={port}", f"GLOO_SOCKET_IFNAME={ifnames[1]}"]
        procs.append(subprocess.Popen([*prefix[1], "env", *env, sys.executable, "-m", "wafer.engine.pipeline"],
                                      cwd=Path(__file__).resolve().parents[2], stdout=logs[1], stderr=subprocess.STDOUT,
                                      start_new_session=True))
        deadline = time.monotonic() + 120
        while True:
            again = subprocess.run(ask, capture_output=True, text=True, timeout=120)
            if again.returncode == 0:
                break
            assert time.monotonic() < deadline and procs[0].poll() is None, again.stderr[-2000:]
            time.sleep(1)
        assert json.loads(again.stdout)["content"] == want.choices[0].message.content
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in logs:
            f.close()
        if isolated:
            for name in ns:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out
