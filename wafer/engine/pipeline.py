"""Pipeline parallelism: a model's layers in N stage processes, tokens flowing from stage to stage.

Rank 0 is the engine's own process: it schedules, samples and runs the first stage (the embedding
and the first layers). Ranks 1..N-1 each hold a contiguous range of the layers (the last one the
head) and their own KV pools, with the same blocks as rank 0's cache, whose tables travel with each
step. Activations go from rank to rank, and the logits from the last rank back to rank 0, with
torch.distributed's point-to-point operations on a gloo process group (NCCL's would serve GPUs).

Up to N steps are in flight at once, each over different sequences (engine.py splits the running
batch): while the last stage computes one step, the first computes the next, so that every stage
works while the others do. Results come back in the order the steps went out.

On one machine rank 0 starts the other stages itself (`spawn_stages`); across machines `torchrun`
starts them (`python -m wafer.engine.pipeline`, see the README). A stage that dies or hangs fails
the steps in flight (StageFailure); rank 0 then starts the stages it owns again.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from wafer.engine.kv_cache import BLOCK, KVCache
from wafer.engine.runner import ModelRunner, StepBatch

log = logging.getLogger("wafer.pipeline")

_STEP, _STOP, _ERROR = 1, 0, 2  # the first field of every message's header


class StageError(RuntimeError):
    """A step raised on a stage: that step's sequences fail (or are run again one by one)."""


class StageFailure(RuntimeError):
    """A stage is gone or does not answer: everything in flight is lost."""


@dataclass
class StageSpec:
    """What a stage process needs to build its part: all ranks read it from the store."""

    model: str  # the model's path, the same on every machine
    compute: str
    ranges: list[tuple[int, int]]  # [start, end) of the layers of each rank
    kv_dtype: torch.dtype
    num_slots: int
    max_len: int
    num_blocks: int
    threads: int  # compute threads of each stage process (0: torch's default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group(store: dist.Store, rank: int, world: int, timeout: float, address: str | None) -> dist.ProcessGroup:
    """A gloo group of the stages. Its sockets go through the interface GLOO_SOCKET_IFNAME names, as
    torch.distributed's own groups do, else this machine's `address`, else the one its host name
    resolves to."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        device = dist.ProcessGroupGloo.create_device(interface=ifname)
    elif address:
        device = dist.ProcessGroupGloo.create_device(hostname=address)
    else:
        device = dist.ProcessGroupGloo.create_default_device()
    opts._devices = [device]
    return dist.ProcessGroupGloo(store, rank, world, opts)


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def _send(pg: dist.ProcessGroup, tensors: list[torch.Tensor], dst: int) -> list[dist.Work]:
    return [pg.send([t.contiguous()], dst, 0) for t in tensors]


def _recv(pg: dist.ProcessGroup, t: torch.Tensor, src: int, timeout: float | None = None) -> torch.Tensor:
    work = pg.recv([t], src, 0)
    if timeout is None:
        work.wait()
    elif not work.wait(datetime.timedelta(seconds=timeout)):
        raise TimeoutError(f"no message from rank {src} in {timeout:.0f} s")
    return t


def _compact(step: StepBatch) -> StepBatch:
    """The step as the next stages need it: the fused step's tables cut to the rows of its slots
    (renumbered) and the blocks up to its furthest position, instead of every slot's whole row."""
    if step.tables is None:
        return step
    used = sorted(set(step.slots.tolist()))
    renumber = {slot: i for i, slot in enumerate(used)}
    blocks = int(step.positions.max()) // BLOCK + 1
    return dataclasses.replace(step, tables=step.tables[used, :blocks].contiguous(),
                               slots=torch.tensor([renumber[s] for s in step.slots.tolist()], dtype=torch.long))


def _bytes(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


# --- ranks 1..N-1 ----------------------------------------------------------------------------------
def build_stage(spec: StageSpec, rank: int) -> ModelRunner:
    """Load the model, keep this rank's layers, and give them KV pools laid out as rank 0's."""
    from wafer.models.loader import load_model
    from wafer.models.stage import keep_stage

    if spec.threads:
        torch.set_num_threads(spec.threads)
    loaded = load_model(spec.model, compute=spec.compute)
    keep_stage(loaded.model, *spec.ranges[rank])  # type: ignore[arg-type]
    kv = KVCache.for_model(loaded.model, spec.num_slots, spec.max_len, spec.num_blocks, spec.kv_dtype)
    return ModelRunner(loaded.model, kv)  # type: ignore[arg-type]


@torch.inference_mode()
def serve_stage(pg: dist.ProcessGroup, rank: int, world: int, runner: ModelRunner) -> None:
    """Compute every step that comes from the rank before, and pass it on (to rank 0 from the last),
    until told to stop. A step that raises here is passed on as an error, not a dead pipeline."""
    hidden_size = runner.model.config.hidden_size
    last = rank == world - 1
    nxt = 0 if last else rank + 1
    while True:
        kind, n_meta, n_tok = _recv(pg, torch.empty(3, dtype=torch.long), rank - 1).tolist()
        if kind == _STOP:
            if not last:
                for w in _send(pg, [torch.tensor([_STOP, 0, 0])], nxt):
                    w.wait()
            return
        payload = _recv(pg, torch.empty(n_meta, dtype=torch.uint8), rank - 1)
        if kind == _ERROR:  # an earlier stage failed this step: pass its message on
            out: list[torch.Tensor] = [torch.tensor([_ERROR, n_meta, 0]), payload]
        else:
            hidden = _recv(pg, torch.empty(n_tok, hidden_size), rank - 1)
            try:
                y = runner.execute(pickle.loads(payload.numpy().tobytes()), hidden)
                if last:
                    out = [torch.tensor([_STEP, y.shape[0], y.shape[1]]), y]
                else:
                    out = [torch.tensor([_STEP, n_meta, n_tok]), payload, y]
            except Exception as e:
                log.exception("stage %d failed a step", rank)
                err = _bytes(f"stage {rank}: {type(e).__name__}: {e}")
                out = [torch.tensor([_ERROR, err.numel(), 0]), err]
        for w in _send(pg, out, nxt):
            w.wait()


def stage_main(host: str, port: int, rank: int, world: int, timeout: float) -> None:
    """A stage process: join rank 0's store, build this rank's part, serve until told to stop."""
    store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    generation = store.get("generation").decode()
    prefixed = dist.PrefixStore(f"wafer/{generation}", store)
    spec: StageSpec = pickle.loads(prefixed.get("spec"))
    runner = build_stage(spec, rank)
    pg = process_group(prefixed, rank, world, timeout, "127.0.0.1" if _loopback(host) else None)
    serve_stage(pg, rank, world, runner)


# --- rank 0 ---------------------------------------------------------------------------------------
class PipelineExecutor:
    """Rank 0's side: runs the first stage of a step, sends it on, and takes the logits back."""

    def __init__(self, runner: ModelRunner, spec: StageSpec, world: int, host: str = "127.0.0.1",
                 port: int | None = None, spawn: bool = True, timeout: float = 120.0,
                 connect_timeout: float = 600.0) -> None:
        """`spawn`: start ranks 1..world-1 here (else torchrun has started them, on any machine).
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
        self._sends: list[tuple[list[dist.Work], list[torch.Tensor]]] = []
        self._pending = 0
        self._ready = threading.Event()
        self._connector: threading.Thread | None = None
        self.transfer_seconds = 0.0  # rank 0's time in sends and receives (its waits for the stages excluded)
        self.wait_seconds = 0.0  # rank 0's time waiting for the last stage's logits
        self.start()

    # --- the stage group ---------------------------------------------------------------------
    def start(self, block: bool = True) -> None:
        """Publish the spec for a new generation of the group, start the stages (when they are
        ours) and connect. With block=False the connection is made in a thread (see ready)."""
        self.generation += 1
        self._ready.clear()
        self.pg = None
        prefixed = dist.PrefixStore(f"wafer/{self.generation}", self.store)
        prefixed.set("spec", pickle.dumps(self.spec))
        self.store.set("generation", str(self.generation))
        if self.spawn:
            self.procs = [self._spawn(rank) for rank in range(1, self.world)]

        def connect() -> None:
            try:
                self.pg = process_group(prefixed, 0, self.world, self.timeout, self.host)  # rank 0 listens on host
                self.fault = None
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
        if self._ready.is_set():
            return True
        if self._connector is not None and not self._connector.is_alive() and self.pg is None:
            self.restart()  # the last attempt failed: try again
        return False

    def stage_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def restart(self) -> None:
        """After a failure: stop what is left of the group, and start it again (connecting in the
        background, so that the server answers meanwhile)."""
        self._kill()
        self._sends.clear()
        self._pending = 0
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
        if self.pg is not None and self._pending == 0 and self._dead() is None:
            try:
                for w in _send(self.pg, [torch.tensor([_STOP, 0, 0])], 1):
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
        meta = _bytes(_compact(step))
        tensors = [torch.tensor([_STEP, meta.numel(), hidden.shape[0]]), meta, hidden]
        t0 = time.perf_counter()
        try:
            self._reap(block=False)
            self._sends.append((_send(self.pg, tensors, 1), tensors))
        except Exception as e:
            raise self._failed(e) from e
        self.transfer_seconds += time.perf_counter() - t0
        self._pending += 1

    def _reap(self, block: bool) -> None:
        """Complete the sends that have gone (their tensors may then be freed)."""
        keep = []
        for works, tensors in self._sends:
            if block:
                for w in works:
                    w.wait(datetime.timedelta(seconds=self.timeout))
            elif not all(w.is_completed() for w in works):
                keep.append((works, tensors))
                continue
        self._sends = keep

    @torch.inference_mode()
    def result(self) -> torch.Tensor:
        """The logits of the oldest step in flight. Raises StageError if a stage raised on it (the
        pipeline goes on), StageFailure if a stage is gone or timed out (everything in flight is lost)."""
        assert self._pending > 0 and self.pg is not None
        last = self.world - 1
        t0 = time.perf_counter()
        try:
            kind, a, b = _recv(self.pg, torch.empty(3, dtype=torch.long), last, self.timeout).tolist()
            t1 = time.perf_counter()
            if kind == _ERROR:
                msg = _recv(self.pg, torch.empty(a, dtype=torch.uint8), last, self.timeout)
                self._pending -= 1
                raise StageError(pickle.loads(msg.numpy().tobytes()))
            logits = _recv(self.pg, torch.empty(a, b), last, self.timeout)
            self._reap(block=False)
        except StageError:
            raise
        except Exception as e:
            raise self._failed(e) from e
        t2 = time.perf_counter()
        self.wait_seconds += t1 - t0
        self.transfer_seconds += t2 - t1
        self._pending -= 1
        return logits

    def check(self) -> None:
        """Raise StageFailure if a stage process of ours has exited (between steps, when nothing
        in flight would notice)."""
        if self._ready.is_set() and (dead := self._dead()) is not None:
            raise self._failed(RuntimeError(dead))


def main(argv: list[str] | None = None) -> None:
    """A stage process. Started by rank 0 on one machine; under torchrun, RANK, WORLD_SIZE and
    MASTER_ADDR name the rank and rank 0's machine, whose store listens on MASTER_PORT + 1."""
    p = argparse.ArgumentParser(prog="python -m wafer.engine.pipeline", description=main.__doc__)
    p.add_argument("--host", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", "29500")) + 1)
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "1")))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for rank 0")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"stage {args.rank}: %(message)s")
    if args.rank < 1:
        raise SystemExit("rank 0 is the server: start it with `wafer serve --pipeline-parallel N`")
    stage_main(args.host, args.port, args.rank, args.world, args.timeout)


if __name__ == "__main__":
    main()
