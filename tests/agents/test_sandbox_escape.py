"""Escape attempts from inside the sandbox. Each test fails if its attempt succeeds: the program
reports what it could observe, and the test asserts that no secret got in and nothing got out.
After each, the host is checked: no process left behind, the test process's files intact."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import signal
import socket
from pathlib import Path

import pytest

import wafer
from tests.agents.drive import PROBE_FDS, SMALL, children, drive, only_its_pipes, wait_gone
from wafer.agents.program import Program, ProgramResult
from wafer.agents.sandbox import Limits, interpreter

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make test installs it)")

SECRET = "wafer-secret-" + secrets.token_hex(8)

# Every attempt reports "READ:<what>" when it got something, "BLOCKED:<why>" when it did not.
TRY_READ = """
def attempt(path):
    try:
        with open(path, 'rb') as f:
            return 'READ:' + f.read(1 << 16).decode(errors='replace')
    except Exception as e:
        return 'BLOCKED:' + type(e).__name__ + ': ' + str(e)
text(attempt({path!r}))
"""


@pytest.fixture(autouse=True)
def host_stays_fine(tmp_path):
    """A sentinel file of the host and the test process's children, before and after each attempt."""
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text(SECRET)
    before = children(os.getpid())
    yield
    assert wait_gone(children(os.getpid()) - before) == set(), "a sandbox process outlived its program"
    assert sentinel.read_text() == SECRET


@pytest.fixture()
def state_db(tmp_path) -> Path:
    """A stand-in for the server's state database, holding a secret."""
    p = tmp_path / "state.sqlite3"
    p.write_text(f"response resp_1 api_key={SECRET}\n")
    return p


@pytest.fixture()
def env_secret(monkeypatch) -> str:
    monkeypatch.setenv("WAFER_TEST_SECRET", SECRET)
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    return SECRET


def read(path: str) -> str:
    result, _ = drive(TRY_READ.format(path=path))
    assert result.status == "completed", result.error
    return result.result


def assert_blocked(out: str, *absent: str) -> None:
    assert out.startswith("BLOCKED:"), out[:300]
    for a in absent:
        assert a not in out


# --- host files ---------------------------------------------------------------------------------

def test_read_server_source():
    source = Path(wafer.__file__).read_text()
    out = read(wafer.__file__)
    assert_blocked(out, source.strip().splitlines()[0])


def test_read_etc_shadow():
    assert_blocked(read("/etc/shadow"))


def test_read_etc_passwd_and_hosts():
    result, _ = drive("import os\ntext(sorted(os.listdir('/')))\ntext(os.path.exists('/etc'))")
    assert result.result.splitlines()[1] == "False"
    assert_blocked(read("/etc/passwd"))
    assert "'work'" not in result.result and "'etc'" not in result.result and "'home'" not in result.result


def test_read_state_database(state_db):
    assert_blocked(read(str(state_db)), SECRET)


def test_list_root_home():
    result, _ = drive("import os\ntext(os.listdir('/root'))\ntext(os.listdir('/root/.pyenv'))")
    # only the path down to the interpreter, nothing else of /root
    assert result.result.splitlines() == ["['.pyenv']", "['versions']"]


def test_read_host_interpreter_site_packages():
    site = interpreter().site_packages
    assert site is not None and os.listdir(site)  # the host has packages there ...
    result, _ = drive(f"import os\ntext(os.listdir({site!r}))\ntry:\n    import pytest\nexcept ImportError as e:\n    text('BLOCKED', e)")
    assert result.result.splitlines()[0] == "[]"  # ... the sandbox sees none, and cannot import them
    assert result.result.splitlines()[1].startswith("BLOCKED")


def test_read_proc_1_environ(env_secret):
    out = read("/proc/1/environ")
    assert env_secret not in out


# --- writes -------------------------------------------------------------------------------------

WRITE = """
def attempt(path):
    try:
        with open(path, 'a') as f:
            f.write('pwned')
        return 'WROTE'
    except Exception as e:
        return 'BLOCKED:' + type(e).__name__ + ': ' + str(e)
text(attempt({path!r}))
"""


@pytest.mark.parametrize("where", ["usr", "interpreter", "root_dir", "dev"])
def test_write_outside_tmpfs(where):
    path = {"usr": "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "interpreter": os.path.join(os.path.dirname(os.__file__), "os.py"),
            "root_dir": "/pwned",
            "dev": "/dev/pwned"}[where]
    before = Path(path).read_bytes() if Path(path).exists() else None
    result, _ = drive(WRITE.format(path=path))
    assert result.result.startswith("BLOCKED:"), result.result
    assert (Path(path).read_bytes() if Path(path).exists() else None) == before


def test_write_to_the_test_directory(tmp_path):
    target = tmp_path / "sentinel.txt"
    result, _ = drive(WRITE.format(path=str(target)))
    assert result.result.startswith("BLOCKED:")
    assert target.read_text() == SECRET


# --- network ------------------------------------------------------------------------------------

def test_tcp_to_the_servers_port():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = f"""
import socket
try:
    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)
    s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')
    text('CONNECTED')
except Exception as e:
    text('BLOCKED:' + type(e).__name__ + ': ' + str(e))
"""
    result, _ = drive(code)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert result.result.startswith("BLOCKED:"), result.result


def test_udp_to_the_host():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(0.5)
    port = rx.getsockname()[1]
    code = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    for _ in range(5):
        s.sendto(b'{SECRET}', ('127.0.0.1', {port}))
    text('SENT')
except Exception as e:
    text('BLOCKED:' + type(e).__name__)
"""
    drive(code)
    with pytest.raises(TimeoutError):
        rx.recvfrom(100)  # sent or not, it arrived in the sandbox's own network namespace, not here
    rx.close()


def test_unix_socket_of_the_host(tmp_path):
    path = tmp_path / "server.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    srv.settimeout(0.5)
    code = f"""
import socket
try:
    socket.socket(socket.AF_UNIX).connect({str(path)!r})
    text('CONNECTED')
except Exception as e:
    text('BLOCKED:' + type(e).__name__)
"""
    result, _ = drive(code)
    with pytest.raises(TimeoutError):
        srv.accept()
    srv.close()
    assert result.result.startswith("BLOCKED:")


def test_abstract_unix_socket_of_the_host():
    name = "\0wafer-test-" + secrets.token_hex(6)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(name)
    srv.listen()
    srv.settimeout(0.5)
    code = f"""
import socket
try:
    socket.socket(socket.AF_UNIX).connect({name!r})
    text('CONNECTED')
except Exception as e:
    text('BLOCKED:' + type(e).__name__)
"""
    result, _ = drive(code)
    with pytest.raises(TimeoutError):
        srv.accept()
    srv.close()
    assert result.result.startswith("BLOCKED:")


def test_netlink_sees_only_its_own_loopback():
    assert len(socket.if_nameindex()) > 1 or socket.if_nameindex()[0][1] != "lo"  # the host has a real interface
    code = """
import socket
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
text(socket.if_nameindex())
"""
    result, _ = drive(code)
    assert result.status == "completed", result.error
    assert result.result.strip() == "[(1, 'lo')]"


def test_reach_the_internet():
    code = """
import socket
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2)
    text('CONNECTED')
except Exception as e:
    text('BLOCKED:' + type(e).__name__ + ': ' + str(e))
"""
    result, _ = drive(code)
    assert result.result.startswith("BLOCKED:") and "unreachable" in result.result


# --- processes and signals ----------------------------------------------------------------------

def test_proc_shows_only_the_sandbox():
    result, _ = drive("import os\ntext(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    pids = [int(p) for p in result.result.strip("[]\n").split(",")]
    assert pids == [1]  # the runner, the PID namespace's init; none of the host's
    assert_blocked(read(f"/proc/{os.getpid()}/cmdline"))


def test_proc_1_shows_nothing_of_the_host(env_secret):
    """/proc/1 is the sandbox's init: bwrap's own would show its argv (the host's paths and binds),
    the server's PATH and the server's working directory."""
    code = """
import os
text(open('/proc/1/cmdline', 'rb').read().split(b'\\0')[:6])
text(open('/proc/1/environ', 'rb').read().split(b'\\0'))
text(os.readlink('/proc/1/cwd'))
"""
    result, _ = drive(code)
    assert result.status == "completed", result.error
    cmdline, environ, cwd = result.result.splitlines()
    assert "bwrap" not in cmdline and "--ro-bind" not in cmdline and "-I" in cmdline  # the runner's own
    assert environ == "[b'HOME=/tmp', b'PATH=" + os.path.join(interpreter().prefix, "bin") + "', b'PWD=/tmp', b'']"
    assert env_secret not in result.result and os.environ["PATH"] not in result.result
    assert cwd == "/tmp"


def test_signal_a_host_process():
    victim = os.getpid()
    code = f"""
import os
for pid in ({victim}, -{victim}):
    try:
        os.kill(pid, 15)
        text('SIGNALLED', pid)
    except Exception as e:
        text('BLOCKED:' + type(e).__name__)
"""
    result, _ = drive(code)
    assert result.result.splitlines() == ["BLOCKED:ProcessLookupError"] * 2


def test_signal_everyone():
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        result, _ = drive("import os\ntry:\n    os.kill(-1, 10)\nexcept Exception as e:\n    text(type(e).__name__)\ntext('alive')")
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == []
    assert "alive" in result.result


def test_read_parent_memory(env_secret):
    code = f"""
import os
for pid in (os.getppid(), {os.getpid()}):
    try:
        with open(f'/proc/{{pid}}/mem', 'rb') as f:
            f.seek(0x400000)
            text('READ:', f.read(4096))
    except Exception as e:
        text('BLOCKED:' + type(e).__name__)
"""
    result, _ = drive(code)
    assert env_secret not in result.result
    assert all(line.startswith("BLOCKED:") for line in result.result.splitlines()), result.result


def test_ptrace():
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
text('host', libc.ptrace(16, {os.getpid()}, None, None), ctypes.get_errno())  # PTRACE_ATTACH
text('init', libc.ptrace(16, 1, None, None), ctypes.get_errno())
text([line.split()[1] for line in open('/proc/1/status') if line.startswith(('Uid', 'CapPrm', 'CapEff', 'CapBnd'))])
"""
    result, _ = drive(code)
    host, init, status = result.result.splitlines()
    assert host == "host -1 3"  # ESRCH: no host process is in reach
    # bwrap's init in the sandbox's PID namespace may be attached (same uid), which grants nothing:
    # it has the program's uid and no capability at all
    assert status == "['65534', '0000000000000000', '0000000000000000', '0000000000000000']"


# --- environment --------------------------------------------------------------------------------

def test_read_server_environment(env_secret):
    code = "import os\ntext(dict(os.environ))\ntext(open('/proc/self/environ', 'rb').read())"
    result, _ = drive(code)
    assert result.status == "completed"
    assert env_secret not in result.result and "WAFER_TEST_SECRET" not in result.result and "OPENAI_API_KEY" not in result.result


# --- resource bombs -----------------------------------------------------------------------------

def test_fork_bomb_counted():
    code = """
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    text('stopped at', n, e.errno)
"""
    result, _ = drive(code)
    assert result.status == "completed", result.error
    words = result.result.split()
    assert words[:2] == ["stopped", "at"] and int(words[2]) <= SMALL.processes and words[3] == "11"  # EAGAIN


def test_fork_bomb_exponential():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result, _ = drive(code, limits=Limits(cpu_seconds=2, wall_seconds=3, processes=16))
    assert result.status == "incomplete"


def test_memory_bomb():
    result, _ = drive("blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))\n")
    assert result.status == "incomplete"
    assert "MemoryError" in result.error and f"memory limit ({SMALL.memory_bytes} bytes)" in result.error


# Memory outside the address space: memfds and /tmp's tmpfs (each memfd under RLIMIT_FSIZE), and
# forked children each under RLIMIT_AS. The program's memory cgroup counts them all.
MEMFDS = """
import os
fds = []
while len(fds) < 32:  # 1 GiB, in files as large as RLIMIT_FSIZE lets them be
    fd = os.memfd_create('hold')
    for _ in range(32):
        assert os.write(fd, b'x' * 2**20) == 2**20
    fds.append(fd)
text('held', len(fds) * 32, 'MiB')
"""
FORKED = """
import os, time
for _ in range(8):  # 8 x 200 MiB, each child under the address-space limit
    if os.fork() == 0:
        blocks = [bytearray(2**20) for _ in range(200)]
        time.sleep(1)
        os._exit(0)
time.sleep(0.5)
text('alive')
"""


def peak_of(code: str, limits: Limits = SMALL) -> tuple[ProgramResult, int]:
    """The program's result and the most memory its cgroup was charged at once."""

    async def run() -> tuple[ProgramResult, int]:
        program = await Program.start(code, [], limits)
        try:
            result = await program.advance()
            assert isinstance(result, ProgramResult)
            return result, program.memory_peak
        finally:
            await program.kill()

    return asyncio.run(run())


def test_memfd_bomb():
    result, peak = peak_of(MEMFDS, dataclasses.replace(SMALL, file_bytes=32 * 2**20))
    assert result.status == "incomplete" and "held" not in result.result, result
    assert f"memory limit ({SMALL.memory_bytes} bytes) reached" in result.error and "memfd" in result.error
    assert peak <= SMALL.memory_bytes


def test_tmpfs_and_page_cache_count():
    """/tmp's pages and the page cache of a file read back are the program's memory too: with /tmp as
    large as the limit, filling it is stopped by the memory limit before the tmpfs is full."""
    limits = Limits(cpu_seconds=2, wall_seconds=5, memory_bytes=64 * 2**20, file_bytes=16 * 2**20, tmp_bytes=256 * 2**20)
    code = """
n = 0
while n < 20:
    with open(f'/tmp/fill{n}', 'wb') as f:
        f.write(b'x' * (10 * 2**20))
    n += 1
text('wrote', n * 10, 'MiB')
"""
    result, peak = peak_of(code, limits)
    assert result.status == "incomplete" and "wrote" not in result.result, result
    assert f"memory limit ({limits.memory_bytes} bytes) reached" in result.error
    assert peak <= limits.memory_bytes


def test_forked_children_share_one_memory_limit():
    result, peak = peak_of(FORKED)
    assert peak <= SMALL.memory_bytes  # not 8 x 200 MiB
    assert result.status == "incomplete" or result.result.strip() == "alive"  # the children were what died


def test_cpu_loop():
    result, _ = drive("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
                      limits=Limits(cpu_seconds=1, wall_seconds=10))
    assert result.status == "incomplete" and "cpu time limit (1 s)" in result.error  # the hard limit kills


def test_disk_fill_one_file():
    code = """
n = 0
try:
    with open('/tmp/fill', 'wb') as f:
        while True:
            f.write(b'x' * 2**20)
            f.flush()
            n += 1
except OSError as e:
    text('stopped at', n, 'MiB', e.errno)
"""
    result, _ = drive(code)
    words = result.result.split()
    assert int(words[2]) <= SMALL.file_bytes // 2**20 and words[4] == "27"  # EFBIG


def test_disk_fill_many_files():
    code = """
n = 0
try:
    while True:
        with open(f'/tmp/fill{n}', 'wb') as f:
            f.write(b'x' * 2**20)
        n += 1
except OSError as e:
    text('stopped at', n, 'MiB', e.errno)
"""
    result, _ = drive(code)
    words = result.result.split()
    assert int(words[2]) <= SMALL.tmp_bytes // 2**20 and words[4] == "28"  # ENOSPC


def test_huge_output():
    result, _ = drive("while True:\n    text('x' * 10**5)\n")
    assert result.status == "incomplete" and result.error.startswith("output over")
    assert len(result.result) <= SMALL.output_bytes


def test_huge_stderr():
    result, _ = drive("import os\nwhile True:\n    os.write(2, b'e' * 65536)\n")
    assert result.status == "incomplete" and result.error.startswith(f"output over {SMALL.output_bytes} bytes (stderr)")
    assert result.error.count("e") <= SMALL.output_bytes + 200


# --- syscalls -----------------------------------------------------------------------------------

def test_ctypes_unshare_and_setns():
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for flag in (0x10000000, 0x00020000, 0x40000000):  # CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET
    text('unshare', libc.unshare(flag), ctypes.get_errno())
fd = os.open('/proc/1/ns/mnt', os.O_RDONLY)
text('setns', libc.setns(fd, 0), ctypes.get_errno())
"""
    result, _ = drive(code)
    lines = result.result.splitlines()
    assert all(line.split()[1] == "-1" for line in lines), result.result


def test_raw_syscalls():
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for name, nr, args in [('mount', 165, (b'none', b'/tmp', b'tmpfs', 0, None)), ('chroot', 161, (b'/tmp',)),
                       ('setuid', 105, (0,)), ('init_module', 175, (None, 0, b'')), ('reboot', 169, (0xfee1dead, 672274793, 0x1234567, None))]:
    text(name, libc.syscall(nr, *args), ctypes.get_errno())
"""
    result, _ = drive(code)
    for line in result.result.splitlines():
        name, r, errno = line.split()
        # EPERM; EINVAL for setuid(0): uid 0 does not even exist in the sandbox's user namespace;
        # ENOSYS for init_module on kernels built without modules
        allowed = {"setuid": (1, 22), "init_module": (1, 38)}.get(name, (1,))
        assert r == "-1" and int(errno) in allowed, line


def test_setuid_chroot_mount_from_python():
    code = """
import os
for name, f in [('setuid', lambda: os.setuid(0)), ('setgid', lambda: os.setgid(0)), ('chroot', lambda: os.chroot('/tmp'))]:
    try:
        f()
        text(name, 'DONE')
    except OSError as e:
        text(name, 'BLOCKED', e.errno)
text(os.getuid(), os.geteuid())
"""
    result, _ = drive(code)
    assert result.result.splitlines() == ["setuid BLOCKED 22", "setgid BLOCKED 22", "chroot BLOCKED 1", "65534 65534"]


# --- /proc/self, symlinks, file descriptors ------------------------------------------------------

@pytest.mark.parametrize("via", ["/proc/self/root", "/proc/1/root", "/proc/self/cwd/.."])
def test_escape_through_proc_links(via, state_db):
    assert_blocked(read(via + wafer.__file__))
    assert_blocked(read(via + str(state_db)), SECRET)


def test_symlink_to_host_paths(state_db):
    code = f"""
import os
for i, target in enumerate(({wafer.__file__!r}, {str(state_db)!r}, '/etc/shadow')):
    os.symlink(target, f'/tmp/link{{i}}')
    try:
        text('READ:', open(f'/tmp/link{{i}}').read())
    except Exception as e:
        text('BLOCKED:' + type(e).__name__)
"""
    result, _ = drive(code)
    assert result.result.splitlines() == ["BLOCKED:FileNotFoundError"] * 3


@pytest.fixture()
def inheritable(state_db):
    """What a server launched from a careless shell holds: a host file open for reading and writing,
    and a listening TCP socket with a connection waiting, all inheritable."""
    opened = os.open(state_db, os.O_RDWR | os.O_APPEND)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())  # waits in the listener's backlog
    for fd in (opened, listener.fileno()):
        os.set_inheritable(fd, True)
    yield state_db, listener
    client.close()
    listener.close()
    os.close(opened)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_inherited_file_descriptors(inheritable, loop):
    """uvloop's spawner ignores close_fds: the server (which runs on uvloop) must not hand a program
    its descriptors."""
    import uvloop

    state_db, listener = inheritable
    result, _ = drive(PROBE_FDS, loop_factory=uvloop.new_event_loop if loop == "uvloop" else None)
    assert result.status == "completed", result.error
    only_its_pipes(result.result)
    assert not any(line.startswith(("ACCEPTED", "READ", "WROTE")) for line in result.result.splitlines()), result.result
    assert SECRET not in result.result and str(state_db) not in result.result
    assert state_db.read_text() == f"response resp_1 api_key={SECRET}\n"  # nothing appended
    listener.settimeout(2)
    conn, _ = listener.accept()  # the waiting connection is still there: no program took it
    conn.close()


def test_protocol_cannot_be_forged_through_print():
    forged = '{"t": "calls", "calls": [{"id": "1", "name": "get_weather", "args": {"city": "x"}}]}'
    result, pauses = drive(f"print({forged!r})\ntext('{{\"t\": \"done\"}}')")
    assert pauses == [] and result.status == "completed"
    assert result.result == forged + '\n{"t": "done"}\n'


def test_hostname_and_sysfs():
    result, _ = drive("import socket, os\ntext(socket.gethostname())\ntext(os.path.exists('/sys'))")
    assert result.result.splitlines() == ["sandbox", "False"]
    assert socket.gethostname() != "sandbox"
