"""The bubblewrap sandbox that model-written programs run in: a read-only stdlib interpreter, a private
tmpfs, new namespaces, no capabilities, no environment, and limits the program cannot raise."""
from __future__ import annotations

import asyncio
import functools
import glob
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

from wafer.agents import cgroup
from wafer.agents.cgroup import ProgramCgroup
from wafer.config import ProgramLimits

# The host uid the sandbox runs as when the server is root: RLIMIT_NPROC is never enforced for a
# process whose real uid is host root (kernel/fork.c, INIT_USER), whatever uid it has inside its
# user namespace, so a root-started sandbox must be a non-root uid on the host for the limit to bite.
SANDBOX_HOST_UID = 65534
# The uid and gid the program sees.
SANDBOX_UID = 65534
TRIAL_TIMEOUT_S = 20.0


class SandboxUnavailable(Exception):
    """bubblewrap is missing or cannot start here; programs are then refused, never run unsandboxed."""


# One program's limits (their defaults are in wafer/config/sandbox.py).
Limits = ProgramLimits


@dataclass
class Interpreter:
    prefix: str  # sys.base_prefix, bound read-only at the same path
    executable: str
    site_packages: str | None  # hidden under an empty read-only tmpfs: stdlib only
    libraries: list[str]  # shared libraries outside the prefix that the interpreter and its extension modules load


def _ldd(paths: list[str]) -> list[str]:
    out = subprocess.run(["ldd", *paths], capture_output=True, text=True, timeout=60).stdout
    libs: set[str] = set()
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
            libs.add(parts[parts.index("=>") + 1])
        elif parts and parts[0].startswith("/") and not line.endswith(":"):
            libs.add(parts[0])  # the dynamic loader itself
    return sorted(libs)


@functools.lru_cache(maxsize=1)
def interpreter() -> Interpreter:
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    if not exe.startswith(prefix + os.sep):
        exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    site = sysconfig.get_path("purelib", vars={"base": prefix, "platbase": prefix})
    dynload = glob.glob(os.path.join(sysconfig.get_path("stdlib", vars={"installed_base": prefix}), "lib-dynload", "*.so"))
    libs = [p for p in _ldd([exe, *dynload]) if not os.path.realpath(p).startswith(prefix + os.sep)]
    return Interpreter(prefix, exe, site if os.path.isdir(site) else None, libs)


def _library_binds(libs: list[str]) -> list[str]:
    args: list[str] = []
    for top in ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"):
        if os.path.islink(top):  # merged /usr: the loader's paths go through these links
            args += ["--symlink", os.readlink(top), top]
    for lib in libs:
        # bound at the real directory, under the name the loader asks for (a soname link's own name)
        dest = os.path.join(os.path.realpath(os.path.dirname(lib)), os.path.basename(lib))
        args += ["--ro-bind", lib, dest]
    return args


def _stage_dir(needed: list[str]) -> str:
    """A directory of the host, above none of the paths the sandbox needs, that a private mount
    namespace may cover."""
    for d in ("/mnt", "/srv", "/media", "/opt", "/tmp", "/var/tmp"):
        if os.path.isdir(d) and not any((os.path.realpath(p) + "/").startswith(d + "/") or (p + "/").startswith(d + "/")
                                        for p in needed):
            return d
    raise SandboxUnavailable("no directory to stage the interpreter in")


def command(args: list[str], limits: Limits) -> list[str]:
    """argv that runs the sandboxed interpreter with `args` (after `python -I -S -B -X utf8`)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    it = interpreter()
    root = os.geteuid() == 0
    # As root the sandbox runs as an unprivileged host uid (see SANDBOX_HOST_UID), which may not be
    # able to reach the prefix (/root is 0700): a private mount namespace shows it at a stage path.
    stage = _stage_dir([it.prefix, bwrap, *it.libraries]) if root else ""
    source = os.path.join(stage, "wafer-python") if root else it.prefix
    argv = [
        # --as-pid-1: the runner is the PID namespace's init, so /proc/1 shows the sandbox's own
        # process (bwrap's reaper would show bwrap's argv, the host's PATH and directory)
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session", "--as-pid-1",
        "--clearenv", "--cap-drop", "ALL",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        "--ro-bind", source, it.prefix,
    ]
    if it.site_packages:
        argv += ["--tmpfs", it.site_packages, "--remount-ro", it.site_packages]
    argv += _library_binds(it.libraries)
    argv += [
        "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
        "--setenv", "HOME", "/tmp", "--setenv", "PATH", os.path.join(it.prefix, "bin"), "--chdir", "/tmp",
        "--remount-ro", "/",
        it.executable, "-I", "-S", "-B", "-X", "utf8", *args,
    ]
    if not root:
        return argv
    script = (
        'mkdir_at="$1"; shift; mount -t tmpfs -o size=64k,mode=0755 wafer-stage "$mkdir_at" '
        '&& mkdir "$mkdir_at/wafer-python" && mount --bind "$0" "$mkdir_at/wafer-python" '
        f'&& exec setpriv --reuid={SANDBOX_HOST_UID} --regid={SANDBOX_HOST_UID} --clear-groups -- "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, it.prefix, stage, *argv]


class SandboxProcess:
    """The sandbox's outermost process, started outside the event loop's spawner (uvloop's ignores
    close_fds, and would hand the program every inheritable descriptor of the server): exactly three
    pipes go in, stdin and stdout for the runner's protocol and stderr. Its exit is seen through a
    pidfd, so no child watcher of the loop is involved."""

    def __init__(self, popen: subprocess.Popen[bytes], cgroup: ProgramCgroup) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.cgroup = cgroup
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = self._popen.wait()
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


async def spawn(args: list[str], limits: Limits) -> tuple[SandboxProcess, int, int, int]:
    """Starts the sandbox in its own process group and its own memory cgroup: (process, its stdin's
    write end, its stdout's read end, its stderr's read end), the parent's ends non-blocking."""
    reason = check_sandbox()
    if reason is not None:
        raise SandboxUnavailable(reason)
    hierarchy = cgroup.find()
    assert not isinstance(hierarchy, str)  # check_sandbox() said so
    group = await asyncio.to_thread(ProgramCgroup, hierarchy, limits.memory_bytes)
    # The process joins its cgroup before bubblewrap starts, so that every page of the sandbox is
    # charged there.
    argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', group.procs_file, *command(args, limits)]
    try:
        popen = await asyncio.to_thread(
            subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            close_fds=True, pass_fds=(), start_new_session=True, cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except BaseException:
        await asyncio.to_thread(group.remove)
        raise
    ends = []
    for f in (popen.stdin, popen.stdout, popen.stderr):
        assert f is not None
        fd = os.dup(f.fileno())
        f.close()
        os.set_blocking(fd, False)
        ends.append(fd)
    return SandboxProcess(popen, group), ends[0], ends[1], ends[2]


def rlimits(limits: Limits) -> dict[str, int]:
    """What the runner sets on itself before it reads the program (inside the user namespace, so that
    RLIMIT_NPROC counts only the sandbox's processes)."""
    return {
        "cpu": max(1, math.ceil(limits.cpu_seconds)),
        "memory": limits.memory_bytes,
        "processes": limits.processes + 1,  # the runner is one of them
        "file": limits.file_bytes,
        "files": 64,
    }


@functools.lru_cache(maxsize=1)
def check_sandbox() -> str | None:
    """None when a trial program runs in the sandbox, else a sentence saying why not (cached)."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    if os.geteuid() == 0 and not (shutil.which("unshare") and shutil.which("setpriv")):
        return "util-linux's unshare and setpriv are needed to drop root for the sandbox"
    reason = cgroup.check()
    if reason is not None:
        return f"programs need a memory cgroup of their own: {reason}"
    try:
        argv = command(["-c", "import os; print('sandbox', os.getuid())"], Limits())
        r = subprocess.run(argv, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S,
                           stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.SubprocessError, SandboxUnavailable) as e:
        return f"the sandbox could not start: {e}"
    if r.returncode != 0 or r.stdout.strip() != f"sandbox {SANDBOX_UID}":
        detail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
        return f"the sandbox could not start: {detail[0]}"
    return None
