"""Ranks 1..N-1: a stage process builds its layers and KV pools, then computes every step that
comes from the rank before and passes it on (to rank 0 from the last), until told to stop.
`python -m wafer.engine.pipeline` starts one (rank 0 does, or torchrun across machines)."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
import time
from collections import deque

import torch
import torch.distributed as dist

from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.engine.pipeline.spec import StageSpec
from wafer.engine.pipeline.wire import (
    ERROR,
    STEP,
    STOP,
    TOKENS,
    Inbox,
    align,
    decode,
    error_text,
    loopback,
    message,
    process_group,
    send,
)
from wafer.engine.sampler import best

log = logging.getLogger("wafer.pipeline")
IDLE_FOREVER = 10 * 365 * 86400.0  # seconds


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
        if step_kind == STOP:
            if not last:
                for w in send(pg, nxt, message(STOP, 0, 0, []), capacity):
                    w.wait()
            return
        if step_kind == ERROR:  # an earlier stage failed this step: pass its message on
            out = message(ERROR, 0, 0, [payload])
        else:
            meta = payload[:a]
            hidden = payload[align(a) : align(a) + 4 * b * hidden_size].view(torch.float32).view(b, hidden_size)
            try:
                started = time.perf_counter()
                step = decode(flags, meta)
                y = runner.execute(step, hidden).float()
                micros += int(1e6 * (time.perf_counter() - started))
                if last and step.argmax_only:  # the same argmax rank 0 would take (sampler.best)
                    tokens = best(y) if y.shape[0] else torch.empty(0, dtype=torch.long)
                    out = message(STEP | TOKENS, y.shape[0], y.shape[1], [tokens], micros)
                elif last:
                    out = message(STEP, y.shape[0], y.shape[1], [y], micros)
                else:
                    out = message(STEP | flags, a, b, [meta, y], micros)
            except Exception as e:
                log.exception("stage %d failed a step", rank)
                out = message(ERROR, 0, 0, [error_text(e, rank)])
        sends.append(send(pg, nxt, out, capacity))
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
    pg = process_group(prefixed, rank, world, IDLE_FOREVER, "127.0.0.1" if loopback(host) else None)
    serve_stage(pg, rank, world, runner, spec)


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

