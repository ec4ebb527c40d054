"""What travels between the stages: steps, hidden states, logits (or tokens) and errors, each as
one buffer of a header and its parts, over a gloo process group's point-to-point operations."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from collections import deque

import torch
import torch.distributed as dist

from wafer.engine.kv_layout import BLOCK
from wafer.engine.model_runner import StepBatch

# A message is one buffer: a header of 5 int64 (kind, two sizes, the payload's bytes, and the
# microseconds the stages after rank 0 have computed on the step so far) and the payload.
STOP, STEP, ERROR = 0, 1, 2
BIG = 16  # flag: the payload did not fit the receiver's buffer and follows on its own (tag 1)
PICKLED = 32  # flag: the step is pickled (the Python model's), not packed as int64 (the fused step's)
TOKENS = 64  # flag: the last stage sends each row's argmax, not its logits (StepBatch.argmax_only)
HEADER = 40


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


def loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def wait_for(work: dist.Work, timeout: float | None, src: int) -> None:
    if timeout is None:
        work.wait()
    elif not work.wait(datetime.timedelta(seconds=timeout)):
        raise TimeoutError(f"no message from rank {src} in {timeout:.0f} s")


def message(kind: int, a: int, b: int, parts: list[torch.Tensor], micros: int = 0) -> torch.Tensor:
    """The header and the bytes of each part, in one buffer: one transfer, not one per part. Each
    part starts at a multiple of 8 bytes, so that the receiver can view it as its own type."""
    raw = [p.contiguous().view(-1).view(torch.uint8) for p in parts]
    n = sum(align(r.numel()) for r in raw)
    msg = torch.empty(HEADER + n, dtype=torch.uint8)
    msg[:HEADER].view(torch.int64).copy_(torch.tensor([kind, a, b, n, micros]))
    at = HEADER
    for r in raw:
        msg[at : at + r.numel()] = r
        at += align(r.numel())
    return msg


def align(n: int) -> int:
    return -(-n // 8) * 8


def send(pg: dist.ProcessGroup, dst: int, msg: torch.Tensor, capacity: int) -> list[dist.Work]:
    if msg.numel() <= capacity:
        return [pg.send([msg], dst, 0)]
    header = msg[:HEADER].clone()
    header.view(torch.int64)[0] |= BIG
    return [pg.send([header], dst, 0), pg.send([msg[HEADER:]], dst, 1)]


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
        wait_for(work, timeout, self.src)
        if self.reuse:
            self._last = buf
        else:
            self._post(torch.empty(self.capacity, dtype=torch.uint8))
        kind, a, b, n, micros = buf[:HEADER].view(torch.int64).tolist()
        if kind & BIG:
            payload = torch.empty(n, dtype=torch.uint8)
            wait_for(self.pg.recv([payload], self.src, 1), timeout, self.src)
            return kind & ~BIG, a, b, micros, payload
        return kind, a, b, micros, buf[HEADER : HEADER + n]


def encode(step: StepBatch) -> tuple[int, torch.Tensor]:
    """The step as the next stages need it, and the flag of its format. The fused step's is packed
    as int64, its tables cut to the rows of its slots (renumbered) and the blocks up to its
    furthest position; the Python model's (masks and chunks) is pickled."""
    if step.tables is None:
        return PICKLED, torch.frombuffer(bytearray(pickle.dumps(step)), dtype=torch.uint8)
    used = sorted(set(step.slots.tolist()))
    renumber = {slot: i for i, slot in enumerate(used)}
    tables = step.tables[:, used, : int(step.positions.max()) // BLOCK + 1]
    slots = torch.tensor([renumber[s] for s in step.slots.tolist()], dtype=torch.long)
    rows = step.rows if step.rows is not None else torch.empty(0, dtype=torch.long)
    sizes = torch.tensor([step.ids.numel(), -1 if step.rows is None else rows.numel(), *tables.shape,
                          int(step.argmax_only)])
    return 0, torch.cat([sizes, step.ids, step.positions, slots, rows, tables.flatten()]).view(torch.uint8)


def decode(flags: int, meta: torch.Tensor) -> StepBatch:
    if flags & PICKLED:
        return pickle.loads(meta.numpy().tobytes())
    v = meta.view(torch.int64)
    n, r, t0, t1, t2, argmax_only = v[:6].tolist()
    at = 6 + 3 * n
    rows = v[at : at + r] if r >= 0 else None
    at += max(r, 0)
    return StepBatch(v[6 : 6 + n], v[6 + n : 6 + 2 * n], v[6 + 2 * n : 6 + 3 * n], rows,
                     v[at : at + t0 * t1 * t2].view(t0, t1, t2), None, bool(argmax_only))


def error_text(e: Exception, rank: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(f"stage {rank}: {type(e).__name__}: {e}".encode()), dtype=torch.uint8)
