"""Pipeline parallelism: a model's layers in N stage processes, tokens flowing from stage to stage.

Rank 0 is the engine's own process: it schedules, samples and runs the first stage (the embedding
and the first layers). Ranks 1..N-1 each hold a contiguous range of the layers (the last one the
head) and their own KV pools, with the same blocks as rank 0's cache, whose tables travel with each
step. Activations go from rank to rank, and the logits (or, for a step that only wants each row's
argmax, the tokens) from the last rank back to rank 0, with torch.distributed's point-to-point
operations on a gloo process group (NCCL's would serve GPUs).

Up to N steps are in flight at once, each over different sequences (engine.py splits the running
batch): while the last stage computes one step, the first computes the next, so that every stage
works while the others do. Results come back in the order the steps went out.

On one machine rank 0 starts the other stages itself (PipelineExecutor's `spawn`); across machines
`torchrun` starts them (`python -m wafer.engine.pipeline`, see the README). A stage that dies or hangs fails
the steps in flight (StageFailure); rank 0 then starts the stages it owns again.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from wafer.engine.kv_cache import BLOCK, KVCache
from wafer.engine.runner import ModelRunner, StepBatch
from wafer.engine.sampler import best

log = logging.getLogger("wafer.pipeline")

# A message is one buffer: a header of 5 int64 (kind, two sizes, the payload's bytes, and the
# microseconds the stages after rank 0 have computed on the step so far) and the payload.
_STOP, _STEP, _ERROR = 0, 1, 2
_BIG = 16  # flag: the payload did not fit the receiver's buffer and follows on its own (tag 1)
_PICKLED = 32  # flag: the step is pickled (the Python model's), not packed as int64 (the fused step's)
_TOKENS = 64  # flag: the last stage sends each row's argmax, not its logits (StepBatch.argmax_only)
_HEADER = 40
_IDLE_FOREVER = 10 * 365 * 86400.0  # seconds


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
    max_step: int  # the most tokens a sequence computes in a step
    window_pool: int  # blocks of the windowed layers' pools (0: every layer keeps every token)
    step_capacity: int = 1 << 22  # bytes of the receive buffers for steps; a larger step goes on its own
    logits_capacity: int = 1 << 22  # and for the logits that come back to rank 0


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


def _wait(work: dist.Work, timeout: float | None, src: int) -> None:
    if timeout is None:
        work.wait()
    elif not work.wait(datetime.timedelta(seconds=timeout)):
        raise TimeoutError(f"no message from rank {src} in {timeout:.0f} s")


def _message(kind: int, a: int, b: int, parts: list[torch.Tensor], micros: int = 0) -> torch.Tensor:
    """The header and the bytes of each part, in one buffer: one transfer, not one per part. Each
    part starts at a multiple of 8 bytes, so that the receiver can view it as its own type."""
    raw = [p.contiguous().view(-1).view(torch.uint8) for p in parts]
    n = sum(_align(r.numel()) for r in raw)
    msg = torch.empty(_HEADER + n, dtype=torch.uint8)
    msg[:_HEADER].view(torch.int64).copy_(torch.tensor([kind, a, b, n, micros]))
    at = _HEADER
    for r in raw:
        msg[at : at + r.numel()] = r
        at += _align(r.numel())
    return msg


def _align(n: int) -> int:
    return -(-n // 8) * 8


def _send(pg: dist.ProcessGroup, dst: int, msg: torch.Tensor, capacity: int) -> list[dist.Work]:
    if msg.numel() <= capacity:
        return [pg.send([msg], dst, 0)]
    header = msg[:_HEADER].clone()
    header.view(torch.int64)[0] |= _BIG
    return [pg.send([header], dst, 0), pg.send([msg[_HEADER:]], dst, 1)]


class Inbox:
    """Messages from one rank, received into buffers posted ahead of them. gloo hands a message
    over only once its receive is posted, and each such hand-over costs a wake-up of the sender's
    I/O thread: with receives posted ahead, a message goes as soon as it is sent, in one transfer."""

    def __init__(self, pg: dist.ProcessGroup, src: int, capacity: int, ahead: int, reuse: bool) -> None:
        """`reuse`: a message's buffer is posted again at the next get() (its payload must be
        used by then); else every message gets a buffer of its own."""
        self.pg, self.src, self.capacity, self.reuse = pg, src, capacity, reuse
        self.posted: deque[tuple[torch.Tensor, dist.Work]] = deque()
        self._last: torch.Tensor | None = None
        for _ in range(ahead):
            self._post(torch.empty(capacity, dtype=torch.uint8))

    def _post(self, buf: torch.Tensor) -> None:
        self.posted.append((buf, self.pg.recv([buf], self.src, 0)))

    def get(self, timeout: float | None = None) -> tuple[int, int, int, int, torch.Tensor]:
        """The next message: kind, its two sizes, the stages' compute so far (µs), its payload (uint8)."""
        if self._last is not None:
            self._post(self._last)
            self._last = None
        buf, work = self.posted.popleft()
        _wait(work, timeout, self.src)
        if self.reuse:
            self._last = buf
        else:
            self._post(torch.empty(self.capacity, dtype=torch.uint8))
        kind, a, b, n, micros = buf[:_HEADER].view(torch.int64).tolist()
        if kind & _BIG:
            payload = torch.empty(n, dtype=torch.uint8)
            _wait(self.pg.recv([payload], self.src, 1), timeout, self.src)
            return kind & ~_BIG, a, b, micros, payload
        return kind, a, b, micros, buf[_HEADER : _HEADER + n]


def _encode(step: StepBatch) -> tuple[int, torch.Tensor]:
    """The step as the next stages need it, and the flag of its format. The fused step's is packed
    as int64, its tables cut to the rows of its slots (renumbered) and the blocks up to its
    furthest position; the Python model's (masks and chunks) is pickled."""
    if step.tables is None:
        return _PICKLED, torch.frombuffer(bytearray(pickle.dumps(step)), dtype=torch.uint8)
    used = sorted(set(step.slots.tolist()))
    renumber = {slot: i for i, slot in enumerate(used)}
    tables = step.tables[:, used, : int(step.positions.max()) // BLOCK + 1]
    slots = torch.tensor([renumber[s] for s in step.slots.tolist()], dtype=torch.long)
    rows = step.rows if step.rows is not None else torch.empty(0, dtype=torch.long)
    sizes = torch.tensor([step.ids.numel(), -1 if step.rows is None else rows.numel(), *tables.shape,
                          int(step.argmax_only)])
    return 0, torch.cat([sizes, step.ids, step.positions, slots, rows, tables.flatten()]).view(torch.uint8)


def _decode(flags: int, meta: torch.Tensor) -> StepBatch:
    if flags & _PICKLED:
        return pickle.loads(meta.numpy().tobytes())
    v = meta.view(torch.int64)
    n, r, t0, t1, t2, argmax_only = v[:6].tolist()
    at = 6 + 3 * n
    rows = v[at : at + r] if r >= 0 else None
    at += max(r, 0)
    return StepBatch(v[6 : 6 + n], v[6 + n : 6 + 2 * n], v[6 + 2 * n : 6 + 3 * n], rows,
                     v[at : at + t0 * t1 * t2].view(t0, t1, t2), None, bool(argmax_only))


def _text(e: Exception, rank: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(f"stage {rank}: {type(e).__name__}: {e}".encode()), dtype=torch.uint8)


@torch.inference_mode()
def measured_costs(model: torch.nn.Module, kv_dtype: torch.dtype, threads: int, rows: int = 8
                   ) -> tuple[list[float], float] | None:
    """Seconds a decode step of `rows` sequences takes in each layer and in the head, measured on
    `threads` threads (a stage's share) with wafer's fused step, before the model is cut; None where
    the step is not the fused one (the split then goes by bytes). Per byte, a layer (its attention
    and activations too) and the head cost different amounts: split by bytes, SmolLM2's first stage
    of two took 0.54 ms a token and the second 0.35."""
    from wafer.models.fused_decode import FusedDecode

    before = torch.get_num_threads()
    head = model.lm_head
    position = 4 * BLOCK - 1  # a short context, as most steps' attention is next to their weights
    kv = KVCache.for_model(model, rows, position + 1, rows * 4, kv_dtype)  # a scratch cache of its own
    try:
        torch.set_num_threads(threads)
        with_head = FusedDecode.build(model, kv.layers, kv.layer_group)  # type: ignore[arg-type]
        model.lm_head = None
        without = FusedDecode.build(model, kv.layers, kv.layer_group)  # type: ignore[arg-type]
        model.lm_head = head
        if with_head is None or without is None:
            return None
        for _ in range(rows):
            slot, _ = kv.allocate()
            kv.reserve(slot, position + 1)
        args = (torch.full((rows,), 1, dtype=torch.long), torch.full((rows,), position, dtype=torch.long),
                torch.arange(rows), kv.tables)

        def best_of(step, out: torch.Tensor) -> float:
            times = []
            for _ in range(7):
                t = time.perf_counter()
                step(*args, out)
                times.append(time.perf_counter() - t)
            return min(times[1:])  # (the first is a warm-up)

        layers_only = best_of(without, torch.empty(0, dtype=torch.long))
        whole = best_of(with_head, torch.arange(rows))
        n = len(model.layers)
        return [layers_only / n] * n, max(0.0, whole - layers_only)
    finally:
        model.lm_head = head
        torch.set_num_threads(before)


# --- ranks 1..N-1 ----------------------------------------------------------------------------------
def build_stage(spec: StageSpec, rank: int) -> ModelRunner:
    """Load the model, keep this rank's layers, and give them KV pools laid out as rank 0's."""
    from wafer.models.loader import load_model
    from wafer.models.stage import keep_stage

    if spec.threads:
        torch.set_num_threads(spec.threads)
    loaded = load_model(spec.model, compute=spec.compute)
    keep_stage(loaded.model, *spec.ranges[rank])  # type: ignore[arg-type]
    kv = KVCache.for_model(loaded.model, spec.num_slots, spec.max_len, spec.num_blocks, spec.kv_dtype, spec.max_step,
                           spec.window_pool)
    return ModelRunner(loaded.model, kv)  # type: ignore[arg-type]


@torch.inference_mode()
def serve_stage(pg: dist.ProcessGroup, rank: int, world: int, runner: ModelRunner, spec: StageSpec) -> None:
    """Compute every step that comes from the rank before, and pass it on (to rank 0 from the last),
    until told to stop. A step that raises here is passed on as an error, not a dead pipeline."""
    hidden_size = runner.model.config.hidden_size
    last = rank == world - 1
    nxt = 0 if last else rank + 1
    inbox = Inbox(pg, rank - 1, spec.step_capacity, 2, reuse=True)
    capacity = spec.logits_capacity if last else spec.step_capacity
    sends: deque[list[dist.Work]] = deque()
    while True:
        kind, a, b, micros, payload = inbox.get()
        step_kind, flags = kind & 3, kind & ~3
        if step_kind == _STOP:
            if not last:
                for w in _send(pg, nxt, _message(_STOP, 0, 0, []), capacity):
                    w.wait()
            return
        if step_kind == _ERROR:  # an earlier stage failed this step: pass its message on
            out = _message(_ERROR, 0, 0, [payload])
        else:
            meta = payload[:a]
            hidden = payload[_align(a) : _align(a) + 4 * b * hidden_size].view(torch.float32).view(b, hidden_size)
            try:
                started = time.perf_counter()
                step = _decode(flags, meta)
                y = runner.execute(step, hidden).float()
                micros += int(1e6 * (time.perf_counter() - started))
                if last and step.argmax_only:  # the same argmax rank 0 would take (sampler.best)
                    tokens = best(y) if y.shape[0] else torch.empty(0, dtype=torch.long)
                    out = _message(_STEP | _TOKENS, y.shape[0], y.shape[1], [tokens], micros)
                elif last:
                    out = _message(_STEP, y.shape[0], y.shape[1], [y], micros)
                else:
                    out = _message(_STEP | flags, a, b, [meta, y], micros)
            except Exception as e:
                log.exception("stage %d failed a step", rank)
                out = _message(_ERROR, 0, 0, [_text(e, rank)])
        sends.append(_send(pg, nxt, out, capacity))
        while len(sends) > 2:  # the next rank has its receives posted ahead: these have gone
            for w in sends.popleft():
                w.wait()


def stage_main(host: str, port: int, rank: int, world: int, timeout: float) -> None:
    """A stage process: join rank 0's store, build this rank's part, serve until told to stop."""
    store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    generation = store.get("generation").decode()
    prefixed = dist.PrefixStore(f"wafer/{generation}", store)
    spec: StageSpec = pickle.loads(prefixed.get("spec"))
    runner = build_stage(spec, rank)
    # A stage waits for its next step as long as the server is idle: its group's own timeout (the
    # bound of a wait without one) must not end it. Rank 0 bounds every step's wait itself.
    pg = process_group(prefixed, rank, world, _IDLE_FOREVER, "127.0.0.1" if _loopback(host) else None)
    serve_stage(pg, rank, world, runner, spec)


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
                for w in _send(self.pg, 1, _message(_STOP, 0, 0, []), self.spec.step_capacity):
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
        flags, meta = _encode(step)
        msg = _message(_STEP | flags, meta.numel(), hidden.shape[0], [meta, hidden.float()])
        try:
            self._sends.append((_send(self.pg, 1, msg, self.spec.step_capacity), msg))
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
        if kind & 3 == _ERROR:
            raise StageError(bytes(payload.numpy()).rstrip(b"\0").decode(errors="replace"))
        if kind & _TOKENS:  # each row's argmax: rows that any argmax gives back as that token
            logits = torch.full((a, b), float("-inf"))
            logits[torch.arange(a), payload[: 8 * a].view(torch.int64)] = 0.0
            return logits
        return payload[: 4 * a * b].view(torch.float32).view(a, b)

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
