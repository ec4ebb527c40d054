"""Runs one model-written program inside the sandbox (stdlib only: this file is the sandboxed
interpreter's whole view of wafer; wafer/agents/program.py is the other end).

argv: IN_FD OUT_FD LIMITS_JSON. The protocol is JSON lines on those two pipes, never on stdout, so
that what the program prints cannot pass for a message. From the runner: {"t":"out","s"} output,
{"t":"calls","calls":[{"id","name","args"}]} (sent when no task can run: the runner then blocks for
one {"t":"results","results":{id:{"value"}|{"error"}}}) and {"t":"done","error"?} at the end. To the
runner: {"t":"start","code","tools":[{"name","params"}]} first, then the results.
The program can write to these pipes itself; the parent trusts nothing in them beyond what the
program could do through its tools and text() anyway.
"""
import ast
import asyncio
import json
import linecache
import os
import resource
import selectors
import sys
import threading
import traceback

PROGRAM_FILE = "<program>"
OUT_CHUNK = 4096


class ToolError(Exception):
    """A tool call the parent refused (its arguments do not match the tool's schema)."""


class Deadlock(Exception):
    pass


def set_limits(limits):
    # Set here rather than before bwrap: inside the new user namespace RLIMIT_NPROC counts only this
    # sandbox's processes, and hard limits are lowered so the program cannot raise them again.
    cpu = limits["cpu"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file"], limits["file"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["files"], limits["files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Channel:
    def __init__(self, in_fd, out_fd):
        self.in_fd, self.out_fd, self.buf = in_fd, out_fd, b""

    def send(self, msg):
        data = (json.dumps(msg, ensure_ascii=True, default=str) + "\n").encode()
        while data:
            data = data[os.write(self.out_fd, data):]

    def read(self):
        while b"\n" not in self.buf:
            chunk = os.read(self.in_fd, 1 << 16)
            if not chunk:
                os._exit(3)  # the parent went away
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class Output:
    """sys.stdout for the program and the sink of text(): buffered messages on the channel."""

    def __init__(self, chan):
        self.chan, self.parts, self.size = chan, [], 0

    def write(self, s):
        s = str(s)
        self.parts.append(s)
        self.size += len(s)
        # line-buffered: what was printed before a timeout or a crash still reaches the parent
        if self.size >= OUT_CHUNK or "\n" in s:
            self.flush()
        return len(s)

    def flush(self):
        if self.parts:
            s, self.parts, self.size = "".join(self.parts), [], 0
            self.chan.send({"t": "out", "s": s})

    def isatty(self):
        return False


class Calls:
    """The program's tool calls: futures that the parent resolves when the program cannot go on."""

    def __init__(self, chan, out):
        self.chan, self.out = chan, out
        self.unsent, self.waiting, self.next_id = [], {}, 1

    def call(self, name, args):
        fut = asyncio.get_running_loop().create_future()
        call_id = str(self.next_id)
        self.next_id += 1
        self.unsent.append({"id": call_id, "name": name, "args": args})
        self.waiting[call_id] = fut
        return fut

    def exchange(self):
        self.out.flush()
        self.chan.send({"t": "calls", "calls": self.unsent})
        self.unsent = []
        reply = self.chan.read()
        for call_id, r in reply.get("results", {}).items():
            fut = self.waiting.pop(call_id, None)
            if fut is None or fut.done():
                continue
            if "error" in r:
                fut.set_exception(ToolError(r["error"]))
            else:
                fut.set_result(r.get("value"))


class Selector(selectors.DefaultSelector):
    """The event loop asks to wait (timeout None or > 0) only when no task can run: that is when the
    calls made so far go to the parent together (calls made with gather come back as one batch)."""

    calls = None

    def select(self, timeout=None):
        if timeout is None or timeout > 0:
            if self.calls.unsent or self.calls.waiting:
                self.calls.exchange()
                timeout = 0
            elif timeout is None and threading.active_count() == 1:
                raise Deadlock("the program waits for something that can never happen")
        return super().select(timeout)


def tool_function(calls, name, params):
    async def tool(*args, **kwargs):
        if len(args) > len(params):
            raise TypeError(f"{name}() takes at most {len(params)} positional arguments ({len(args)} given)")
        for p, a in zip(params, args):
            if p in kwargs:
                raise TypeError(f"{name}() got multiple values for argument '{p}'")
            kwargs[p] = a
        return await calls.call(name, kwargs)

    tool.__name__ = tool.__qualname__ = name
    return tool


def program_traceback(e):
    """The traceback without the runner's own frames (noise to the model)."""
    te = traceback.TracebackException.from_exception(e)
    runner = __file__ if "__file__" in globals() else "<string>"
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != runner])
    return "".join(te.format())


def main():
    in_fd, out_fd, limits = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    set_limits(limits)
    chan = Channel(in_fd, out_fd)
    start = chan.read()
    out = Output(chan)
    calls = Calls(chan, out)
    Selector.calls = calls
    error = None
    try:
        source = start["code"]
        linecache.cache[PROGRAM_FILE] = (len(source), None, source.splitlines(True), PROGRAM_FILE)
        code = compile(source, PROGRAM_FILE, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as e:
        error = "".join(traceback.format_exception_only(type(e), e))
    if error is None:

        def text(*values, sep=" ", end="\n"):
            out.write(sep.join(str(v) for v in values) + end)

        env = {"__name__": "__main__", "__builtins__": __builtins__, "asyncio": asyncio, "json": json,
               "text": text, "print": text, "ToolError": ToolError}
        for t in start["tools"]:
            env[t["name"]] = tool_function(calls, t["name"], t["params"])
        sys.stdout = out

        async def run():
            r = eval(code, env)
            if asyncio.iscoroutine(r):
                await r

        loop = asyncio.SelectorEventLoop(Selector())
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(run())
        except Deadlock as e:
            error = f"Deadlock: {e}"
        except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included: the program's end
            if isinstance(e, SystemExit) and e.code in (None, 0):
                error = None
            else:
                error = program_traceback(e)
                if isinstance(e, MemoryError):
                    error += f"memory limit ({limits['memory']} bytes) reached\n"
    try:
        out.flush()
    except BaseException as e:  # noqa: BLE001
        error = error or repr(e)
    chan.send({"t": "done"} if error is None else {"t": "done", "error": error})
    sys.stdout.flush = lambda: None
    os._exit(0)


if __name__ == "__main__":
    main()
