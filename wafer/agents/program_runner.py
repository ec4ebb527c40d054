"""Runs one model-written program inside the sandbox (stdlib only: this file is the sandboxed
interpreter's whole view of wafer; wafer/agents/program.py is the other end).

argv: LIMITS_JSON. The sandbox has exactly three descriptors, all pipes to the parent: stdin and
stdout carry the protocol, stderr is the program's. The protocol is JSON lines; what the program
prints goes through text() into {"t":"out"} messages, so that it cannot pass for a message (a raw
write to descriptor 1 can, and then breaks the protocol: the program ends). From the runner: {"t":"out","s"} output,
{"t":"calls","calls":[{"id","name","args"}]} (sent when no task can run: the runner then blocks for
one {"t":"results","results":{id:{"value"}|{"error"}}}) and {"t":"done","error"?} at the end. To the
runner: {"t":"start","code","tools":[{"name","params"}]} first, then the results.
The program can write to these pipes itself; the parent trusts nothing in them beyond what the
program could do through its tools and text() anyway.
"""
import ast
import asyncio
import io
import json
import linecache
import os
import resource
import selectors
import signal
import sys
import threading
import traceback

PROGRAM_FILE = "<program>"
OUT_CHUNK = 4096
IN_FD, OUT_FD = 0, 1


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


def close_other_descriptors():
    """Every descriptor but the three pipes ends here, before the program is read: whatever the
    sandbox was started with (the parent's spawner is the first guard)."""
    os.closerange(3, 2**31 - 1)  # close_range(2): as cheap for every number as for those open


def be_init():
    """The runner is the PID namespace's init (bwrap --as-pid-1: /proc/1 is the runner, with the
    sandbox's own argv, environment and directory). The kernel ignores signals with their default
    action at an init, so the soft CPU limit's SIGXCPU ends the runner here, as it ends any process."""
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))


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
    close_other_descriptors()
    be_init()
    limits = json.loads(sys.argv[1])
    set_limits(limits)
    chan = Channel(IN_FD, OUT_FD)
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

        def text(*values, sep=" ", end="\n", file=None, flush=False):
            """print's signature: `file` other than stdout writes there, `flush` is accepted (output
            is line-buffered to the parent anyway)."""
            if file is not None and file is not sys.stdout and file is not out:
                print(*values, sep=sep, end=end, file=file, flush=flush)
                return
            out.write((" " if sep is None else sep).join(str(v) for v in values) + ("\n" if end is None else end))
            if flush:
                out.flush()

        env = {"__name__": "__main__", "__builtins__": __builtins__, "asyncio": asyncio, "json": json,
               "text": text, "print": text, "ToolError": ToolError}
        for t in start["tools"]:
            env[t["name"]] = tool_function(calls, t["name"], t["params"])
        sys.stdout = out
        sys.stdin = io.StringIO()  # descriptor 0 is the protocol: input() must not read the parent's replies

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
