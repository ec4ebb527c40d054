"""A `wafer serve` subprocess on a free loopback port, and its state as a client can read it: running and
waiting requests from /health, the KV cache in use from /metrics, resident memory from /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class State:
    running: int
    waiting: int
    kv_usage: float  # wafer:kv_cache_usage_perc: tokens held by live sequences / capacity (the cache is slot-based)
    rss_mb: float

    def row(self) -> list[str]:
        return [str(self.running), str(self.waiting), f"{self.kv_usage:.4f}", f"{self.rss_mb:.1f}"]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        """VmRSS of the server process (the process Popen started: `python -m wafer.cli serve`)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc status")

    def gauge(self, name: str) -> float:
        """A gauge of /metrics, summed over its labels (the engines)."""
        total = None
        for family in text_string_to_metric_families(httpx.get(self.root + "/metrics", timeout=30).text):
            for s in family.samples:
                if s.name == name:
                    total = (total or 0.0) + s.value
        if total is None:
            raise RuntimeError(f"/metrics has no {name}")
        return total

    def state(self) -> State:
        health = httpx.get(self.root + "/health", timeout=30).json()
        return State(health["running"], health["waiting"], self.gauge("wafer:kv_cache_usage_perc"), self.rss_mb())

    def wait_idle(self, timeout: float = 120.0) -> tuple[State, float]:
        """The state once nothing runs or waits and no KV is held, and the seconds that took; at the timeout,
        the state as it is (the caller's criteria then fail on it)."""
        start = time.monotonic()
        while True:
            st = self.state()
            if (st.running == 0 and st.waiting == 0 and st.kv_usage == 0.0) or time.monotonic() - start > timeout:
                return st, time.monotonic() - start
            time.sleep(0.25)

    def stop(self) -> int | None:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start(extra: list[str], log: Path, timeout: float = 300.0, env: dict[str, str] | None = None) -> Server:
    """`wafer serve` with `extra` arguments on a free port, its output in `log`; returns once /health
    answers. `env`: variables set for it over this process's (OMP_NUM_THREADS, say)."""
    # A SIGTERM to the script must still stop its server (the `finally` that calls stop() runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port()
    cmd = [sys.executable, "-m", "wafer.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    log.parent.mkdir(parents=True, exist_ok=True)
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
                            env={**os.environ, **env} if env else None)
    server = Server(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"wafer serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(server.root + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"wafer serve did not come up in {timeout:.0f} s; see {log}")


def server_errors(server: Server) -> dict[str, float]:
    """wafer:request_errors by status, as the server counted them."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server.root + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "wafer:request_errors_total":
                found[s.labels["status"]] = found.get(s.labels["status"], 0) + s.value
    return found


def log_problems(server: Server) -> list[str]:
    lines = server.log.read_text(errors="replace").splitlines()
    return [ln for ln in lines if "Traceback" in ln or " ERROR " in ln or "CRITICAL" in ln]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report_server(errors_seen: dict[str, float], problems: list[str], code: int | None) -> None:
    print(f"server-counted errors (wafer:request_errors by status): {errors_seen or 'none'}; "
          f"error lines in its log: {len(problems)}; exit code after SIGTERM: {code}")
    for line in problems[:10]:
        print(f"  log: {line}")


def judge(checks: list[tuple[str, bool]]) -> int:
    """Print PASS/FAIL per criterion; the exit status."""
    print()
    for name, ok in checks:
        print(f"{verdict(ok)}  {name}")
    return 0 if all(ok for _, ok in checks) else 1
