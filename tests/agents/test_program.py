"""Program: pauses on tool calls, resumes with their outputs, and ends incomplete (never raising) on
errors, limits and kills. Runs the real sandbox."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from tests.agents.drive import SMALL, children, drive, wait_gone
from wafer.agents.program import Program, ProgramResult, ToolSpec
from wafer.agents.sandbox import Limits

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test installs it)")

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                                   "required": ["city"], "additionalProperties": False})
TEMPS = {"Paris": 18, "Oslo": 4, "Rome": 25}


def weather(call) -> str:
    return json.dumps({"city": json.loads(call.arguments)["city"], "temp": TEMPS[json.loads(call.arguments)["city"]]})


def test_three_calls_in_a_loop_pause_three_times():
    code = ("total = 0\n"
            "for city in ['Paris', 'Oslo', 'Rome']:\n"
            "    w = await get_weather(city=city)\n"
            "    total += w['temp']\n"
            "text('total', total)\n")
    result, pauses = drive(code, [WEATHER], answer=weather)
    assert [[json.loads(c.arguments) for c in p] for p in pauses] == [[{"city": "Paris"}], [{"city": "Oslo"}], [{"city": "Rome"}]]
    assert all(c.name == "get_weather" and c.call_id.startswith("call_") for p in pauses for c in p)
    assert len({c.call_id for p in pauses for c in p}) == 3
    assert result == ProgramResult("completed", "total 47\n", None)


def test_gather_comes_back_as_one_pause():
    code = ("ws = await asyncio.gather(get_weather('Paris'), get_weather(city='Oslo'), get_weather('Rome', unit='C'))\n"
            "text(sorted(w['temp'] for w in ws))\n")
    result, pauses = drive(code, [WEATHER], answer=weather)
    assert len(pauses) == 1
    assert sorted(json.loads(c.arguments)["city"] for c in pauses[0]) == ["Oslo", "Paris", "Rome"]
    assert {"city": "Rome", "unit": "C"} in [json.loads(c.arguments) for c in pauses[0]]
    assert result.status == "completed" and result.result == "[4, 18, 25]\n"


def test_outputs_that_are_not_json_come_back_as_text():
    result, _ = drive("r = await get_weather(city='Paris')\ntext(type(r).__name__, r)", [WEATHER], answer=lambda c: "sunny, 18 C")
    assert result.result == "str sunny, 18 C\n"


def test_schema_violation_caught_by_the_program():
    code = ("try:\n"
            "    await get_weather(city=3)\n"
            "except ToolError as e:\n"
            "    text('caught:', e)\n"
            "text(await get_weather(city='Oslo'))\n")
    result, pauses = drive(code, [WEATHER], answer=weather)
    assert len(pauses) == 1 and json.loads(pauses[0][0].arguments) == {"city": "Oslo"}  # the bad call never left
    assert result.status == "completed"
    assert result.result.splitlines()[0] == "caught: get_weather: 3 is not of type 'string'"


def test_schema_violation_uncaught_is_incomplete():
    result, pauses = drive("await get_weather(town='Paris')", [WEATHER])
    assert pauses == []
    assert result.status == "incomplete"
    assert "ToolError: get_weather: 'city' is a required property" in result.error
    assert 'File "<program>", line 1' in result.error


def test_unknown_tool_is_a_name_error():
    result, _ = drive("await get_wether(city='Paris')", [WEATHER])
    assert result.status == "incomplete" and "NameError: name 'get_wether' is not defined" in result.error


def test_exception_is_incomplete_with_the_traceback():
    result, _ = drive("text('before')\ndef f(x):\n    return 1 / x\nf(0)\n")
    assert result.status == "incomplete"
    assert result.result == "before\n"
    assert 'File "<program>", line 4' in result.error and "return 1 / x" in result.error
    assert result.error.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "program_runner" not in result.error and '"<string>"' not in result.error


def test_syntax_error():
    result, _ = drive("for x in range(3)\n    text(x)\n")
    assert result.status == "incomplete" and "SyntaxError" in result.error and "line 1" in result.error


def test_wall_timeout():
    result, _ = drive("import time\ntext('started')\ntime.sleep(30)\n", limits=Limits(wall_seconds=1.5, cpu_seconds=5))
    assert result == ProgramResult("incomplete", "started\n", "timed out after 1.5 s")


def test_wall_time_excludes_time_parked():
    async def run() -> ProgramResult:
        p = await Program.start("import time\nfor i in range(3):\n    time.sleep(0.4)\n    await get_weather(city='Oslo')\ntext('done')",
                                [WEATHER], Limits(wall_seconds=2, cpu_seconds=5))
        while isinstance(r := await p.advance(), list):
            await asyncio.sleep(1.0)  # the client takes its time: 3 s parked in all
            await p.resume({c.call_id: "{}" for c in r})
        return r

    assert asyncio.run(run()) == ProgramResult("completed", "done\n", None)


def test_cpu_loop_hits_the_cpu_limit():
    result, _ = drive("while True:\n    pass\n", limits=Limits(cpu_seconds=1, wall_seconds=10))
    assert result.status == "incomplete" and result.error == "cpu time limit (1 s) exceeded"


def test_oversize_output():
    result, _ = drive("for i in range(10**6):\n    print('x' * 99)\n")
    assert result.status == "incomplete" and result.error == f"output over {SMALL.output_bytes} bytes"
    assert len(result.result.encode()) <= SMALL.output_bytes


def test_output_at_the_limit_is_complete():
    result, _ = drive(f"text('y' * {SMALL.output_bytes - 1})")
    assert result.status == "completed" and len(result.result) == SMALL.output_bytes


def test_kill_frees_the_processes():
    async def run() -> tuple[set[int], set[int], ProgramResult]:
        p = await Program.start("await get_weather(city='Paris')", [WEATHER], SMALL)
        calls = await p.advance()
        assert isinstance(calls, list) and len(calls) == 1
        pids = {p.pid} | children(p.pid)
        await p.kill()
        await p.kill()  # idempotent
        return pids, wait_gone(pids), await p.advance()

    pids, left, after = asyncio.run(run())
    assert len(pids) >= 2  # bwrap and the runner, its PID namespace's init
    assert left == set()
    assert after.status == "incomplete" and after.error == "killed"


def test_resume_needs_exactly_the_calls():
    async def run() -> None:
        p = await Program.start("await asyncio.gather(get_weather(city='Paris'), get_weather(city='Oslo'))", [WEATHER], SMALL)
        try:
            calls = await p.advance()
            with pytest.raises(ValueError, match="missing"):
                await p.resume({calls[0].call_id: "{}"})
            with pytest.raises(ValueError, match="unknown"):
                await p.resume({c.call_id: "{}" for c in calls} | {"call_nope": "{}"})
            await p.resume({c.call_id: "{}" for c in calls})
            assert (await p.advance()).status == "completed"
        finally:
            await p.kill()

    asyncio.run(run())


def test_tool_names_must_be_python_names():
    with pytest.raises(ValueError):
        asyncio.run(Program.start("pass", [ToolSpec("get-weather", {})]))
    with pytest.raises(ValueError):
        asyncio.run(Program.start("pass", [ToolSpec("text", {})]))


def test_print_takes_prints_keywords():
    code = ("import sys\n"
            "print('a', 'b', sep='-', end='!\\n', flush=True)\n"
            "print('to stderr', file=sys.stderr, flush=True)\n"
            "print('c', file=sys.stdout)\n"
            "print(1, 2, sep=None, end=None)\n")
    result, _ = drive(code)
    assert result == ProgramResult("completed", "a-b!\nc\n1 2\n", None)


def test_a_raw_write_to_stdout_ends_the_program_with_a_reason():
    code = "import os\nos.write(1, b'not a message\\n')\ntext('after')\n"
    result, _ = drive(code)
    assert result.status == "incomplete" and "print through print() or text()" in result.error
