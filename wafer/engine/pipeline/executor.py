"""Rank 0's side of the pipeline: it starts the stage processes (or waits for torchrun's), runs
the first stage of each step, sends it on, and takes the logits back."""

from __future__ import annotations

import datetime
import logging
import pickle
import subprocess
import sys
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from wafer.engine.model_runner import ModelRunner, StepBatch
from wafer.engine.pipeline.spec import StageError, StageFailure, StageSpec
from wafer.engine.pipeline.wire import ERROR, STEP, STOP, TOKENS, Inbox, encode, free_port, message, process_group, send

log = logging.getLogger("wafer.pipeline")


class PipelineExecutor:
    """Rank 0's side: runs the first stage of a step, sends it on, and takes the logits back."""

    def __init__(self, runner: ModelRunner, spec: StageSpec, world: int, host: str, port: int | None, spawn: bool,
                 timeout: float, connect_timeout: float = 600.0) -> None:
        """`host`, `port`, `spawn` and `timeout`: EngineConfig's pipeline_* settings.
        `spawn`: start ranks 1..world-1 here (else torchrun has started them, on any machine).
        `timeout`: seconds a step may take through the pipeline before its stage counts as hung."""
        self.runner = runner
        self.spec = spec
        self.world = world
        self.depth = world  # steps in flight at once: one per stage
        self.host = host
        self.spawn = spawn
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.procs: list[subprocess.Popen] = []
        self.store = dist.TCPStore(host, port if port is not None else free_port(), world, is_master=True,
                                   wait_for_workers=False, timeout=datetime.timedelta(seconds=connect_timeout))
        self.generation = 0
        self.pg: dist.ProcessGroup | None = None
        self.fault: str | None = None  # why the pipeline is not serving now (None: it is)
        self.restarts = 0
        self._sends: list[tuple[list[dist.Work], torch.Tensor]] = []
        self._sent: deque[float] = deque()  # when each step in flight was sent on
        self.inbox: Inbox | None = None
        self._ready = threading.Event()
        self._connector: threading.Thread | None = None
        self.transfer_seconds = 0.0  # the rest of each step's time from its send to its logits
        self.bytes_sent = self.bytes_received = 0
        self.start()

    # --- the stage group ---------------------------------------------------------------------
    def start(self, block: bool = True) -> None:
        """Publish the spec for a new generation of the group, start the stages (when they are
        ours) and connect. With block=False the connection is made in a thread (see ready)."""
        self.generation += 1
        self._ready.clear()
        self.pg = self.inbox = None
        prefixed = dist.PrefixStore(f"wafer/{self.generation}", self.store)
        prefixed.set("spec", pickle.dumps(self.spec))
        self.store.set("generation", str(self.generation))
        if self.spawn:
            self.procs = [self._spawn(rank) for rank in range(1, self.world)]

        def connect() -> None:
            try:
                # Joining waits for every stage to load its model: the connect timeout, not a step's.
                pg = process_group(prefixed, 0, self.world, self.connect_timeout, self.host)  # rank 0 listens on host
                inbox = Inbox(pg, self.world - 1, self.spec.logits_capacity, self.depth, reuse=False)
                self.pg, self.inbox, self.fault = pg, inbox, None
                self._ready.set()
            except Exception as e:  # noqa: BLE001 (reported through `fault`, and tried again)
                log.error("pipeline stages did not connect: %s", e)
                self.fault = f"pipeline stages did not connect: {e}"

        if block:
            connect()
            if self.pg is None:
                self.close()
                raise StageFailure(self.fault)
        else:
            self._connector = threading.Thread(target=connect, name="wafer-pipeline-connect", daemon=True)
            self._connector.start()

    def _spawn(self, rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "wafer.engine.pipeline", "--host", self.host,
               "--port", str(self.store.port), "--rank", str(rank), "--world", str(self.world),
               "--timeout", str(self.connect_timeout)]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    @property
    def ready(self) -> bool:
        """Whether the stages are connected; after a failure, False until they are again."""
        return self._ready.is_set()

    def retry(self) -> None:
        """Start the stages again if the last attempt to connect them has failed (the engine's
        step calls this while the pipeline is not ready; a health check only reads `ready`)."""
        if not self._ready.is_set() and self._connector is not None and not self._connector.is_alive():
            self.restart()

    def stage_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def restart(self) -> None:
        """After a failure: stop what is left of the group, and start it again (connecting in the
        background, so that the server answers meanwhile)."""
        self._kill()
        self._sends.clear()
        self._sent.clear()
        self.restarts += 1
        self.start(block=False)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("stage process %d did not exit", p.pid)
        self.procs = []

    def _dead(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"pipeline stage {rank} (pid {p.pid}) exited with status {p.returncode}"
        return None

    def _failed(self, error: Exception) -> StageFailure:
        self.fault = self._dead() or f"pipeline stage failed: {type(error).__name__}: {error}"
        self._ready.clear()
        return StageFailure(self.fault)

    def close(self) -> None:
        """Tell the stages to stop, and make sure they have."""
        if self.pg is not None and not self._sent and self._dead() is None:
            try:
                for w in send(self.pg, 1, message(STOP, 0, 0, []), self.spec.step_capacity):
                    w.wait(datetime.timedelta(seconds=5))
                for p in self.procs:
                    p.wait(timeout=10)
            except Exception:  # noqa: BLE001 (they are killed below)
                pass
        self._kill()
        self.pg = None

    # --- steps --------------------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, step: StepBatch) -> None:
        """Run the first stage of `step` here and send it on; its logits come from result(), in turn.
        Raises StageError if the first stage raised, StageFailure if the pipeline is broken."""
        if self.pg is None or not self._ready.is_set():
            raise StageFailure(self.fault or "the pipeline stages are not connected")
        try:
            hidden = self.runner.execute(step)
        except Exception as e:
            raise StageError(f"stage 0: {type(e).__name__}: {e}") from e
        flags, meta = encode(step)
        msg = message(STEP | flags, meta.numel(), hidden.shape[0], [meta, hidden.float()])
        try:
            self._sends.append((send(self.pg, 1, msg, self.spec.step_capacity), msg))
        except Exception as e:
            raise self._failed(e) from e
        self._sent.append(time.perf_counter())
        self.bytes_sent += msg.numel()

    def _reap_oldest(self) -> None:
        """Complete the oldest step's sends (their tensors may then be freed). Called once its
        logits are back, so that the next stage has long received them: gloo's works say they are
        complete only when waited for."""
        if self._sends:
            works, _ = self._sends.pop(0)
            for w in works:
                w.wait(datetime.timedelta(seconds=self.timeout))

    @torch.inference_mode()
    def result(self) -> torch.Tensor:
        """The logits of the oldest step in flight. Raises StageError if a stage raised on it (the
        pipeline goes on), StageFailure if a stage is gone or timed out (everything in flight is lost)."""
        assert self._sent and self.pg is not None and self.inbox is not None
        try:
            kind, a, b, micros, payload = self.inbox.get(self.timeout)
            self._reap_oldest()
        except Exception as e:
            raise self._failed(e) from e
        # From the step's send to its logits: the later stages' compute, and the rest, which is
        # transfers between stages (and, with several steps in flight, waiting behind another).
        self.transfer_seconds += max(0.0, time.perf_counter() - self._sent.popleft() - micros / 1e6)
        self.bytes_received += payload.numel()
        if kind & 3 == ERROR:
            raise StageError(bytes(payload.numpy()).rstrip(b"\0").decode(errors="replace"))
        if kind & TOKENS:  # each row's argmax: rows that any argmax gives back as that token
            logits = torch.full((a, b), float("-inf"))
            logits[torch.arange(a), payload[: 8 * a].view(torch.int64)] = 0.0
            return logits
        return payload[: 4 * a * b].view(torch.float32).view(a, b)

    def check(self) -> None:
        """Raise StageFailure if a stage process of ours has exited (between steps, when nothing
        in flight would notice)."""
        if self._ready.is_set() and (dead := self._dead()) is not None:
            raise self._failed(RuntimeError(dead))
