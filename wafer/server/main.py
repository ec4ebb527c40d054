"""`wafer serve`: load the model, start the engine thread, serve HTTP, shut down gracefully."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import signal
import sys
import time
from types import FrameType

import uvicorn

from wafer import __version__
from wafer.engine.async_engine import AsyncEngine
from wafer.engine.engine import EngineConfig, LLMEngine
from wafer.models.loader import LoadedModel
from wafer.server.app import create_app
from wafer.server.generation import ServedModel

log = logging.getLogger("wafer.server")


def build_served(loaded: LoadedModel, names: list[str], max_running: int, max_waiting: int,
                 max_model_len: int | None, max_batched_tokens: int = 256) -> ServedModel:
    engine = LLMEngine(loaded, EngineConfig(max_running=max_running, max_model_len=max_model_len,
                                            max_batched_tokens=max_batched_tokens))
    engine.warmup()
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    async_engine.start()
    digest = hashlib.sha256(f"{loaded.name}:{loaded.config.quantization}:{__version__}".encode()).hexdigest()
    return ServedModel(
        names=names or [loaded.name],
        engine=async_engine,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        max_model_len=engine.max_model_len,
        fingerprint=f"fp_{digest[:10]}",
    )


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new requests, let running ones finish for `grace` seconds,
    end the rest with a final chunk, then stop. A second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, served: ServedModel, grace: float) -> None:
        super().__init__(config)
        self.served = served
        self.grace = grace
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self._draining = True
        self.served.engine.accepting = False
        log.info("shutting down: finishing running requests (up to %.0fs)", self.grace)
        asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace
        while not self.served.engine.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.served.engine.idle:
            log.info("grace period over: ending the remaining requests")
            self.served.engine.finish_all("length")
            await asyncio.sleep(0.5)  # let the final chunks reach their clients
        self.should_exit = True


def serve(args: argparse.Namespace) -> int:
    from wafer.cli import load_with_progress

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_with_progress(args.model)
    served = build_served(loaded, args.served_model_name, args.max_running, args.max_waiting, args.max_model_len,
                          args.max_batched_tokens)
    app = create_app(served, args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config, served, args.shutdown_grace)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"wafer {__version__} serving {', '.join(served.names)} on http://{host}:{args.port}/v1 "
          f"(max {args.max_running} running, context {served.max_model_len})", file=sys.stderr, flush=True)
    server.run()
    served.engine.stop()
    return 0
