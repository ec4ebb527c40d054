"""The least a Python server does per streamed token: a baseline to compare `wafer serve` with.

It serves POST /v1/chat/completions, streamed, for one request at a time: wafer's engine stepped on
a uvloop event loop (as `wafer serve` steps it), and each step's token written to the socket as
the same server-sent event, straight from the loop: no ASGI, no framework, no queue, no validation.
Its compute workers are idle between steps as `wafer serve` makes them (engine/compute_threads.py).
bench/server_decode.py runs it beside `wafer serve` with the same client: what it loses against the
engine in process is what streaming over loopback costs on this machine (the write, the client
woken, the client's own work), so that is told apart from what wafer's HTTP layer costs.

    python bench/minimal_server.py --port 8432 --quant q4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--quant", default="q4")
    args = ap.parse_args()

    import torch
    import uvloop

    from wafer.engine.compute_threads import ComputeThreads
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model
    from wafer.server.generation import TEXT_HOLE, sse, text_event

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    loaded = load_model(compute=args.quant)
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=2048, prefix_caching=False))
    busy = asyncio.Lock()
    workers = ComputeThreads(torch.get_num_threads())  # idle between steps, as `wafer serve` sets them

    async def stream(transport: asyncio.WriteTransport, req: dict) -> None:
        def write(event: str) -> None:  # one chunk of the chunked body
            body = event.encode()
            transport.write(b"%x\r\n%s\r\n" % (len(body), body))

        async with busy:
            ids = loaded.tokenizer.encode(loaded.chat_template.render(req["messages"]), add_special_tokens=False)
            seq = engine.add(ids, SamplingParams(max_tokens=req["max_tokens"], temperature=0,
                                                 ignore_eos=bool(req.get("ignore_eos"))))
            transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            head = {"id": "chatcmpl-minimal", "object": "chat.completion.chunk", "created": 0, "model": req["model"],
                    "system_fingerprint": "minimal"}
            # The event wafer serve sends for nearly every token, made the same way.
            text = text_event({**head, "choices": [{"index": 0, "delta": {"content": TEXT_HOLE}, "logprobs": None,
                                                     "finish_reason": None}], "usage": None})
            write(text(""))
            with torch.inference_mode():
                while not seq.finished:
                    workers.busy()
                    outputs = engine.step()
                    workers.idle()
                    for out in outputs:
                        if out.text:
                            write(text(out.text))
                    await asyncio.sleep(0)
            write(sse({**head, "choices": [], "usage": {"prompt_tokens": len(ids),
                                                        "completion_tokens": len(seq.output_ids)}}))
            write("data: [DONE]\n\n")
            transport.write(b"0\r\n\r\n")
            transport.close()

    class Connection(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport, self.data = transport, b""

        def data_received(self, data: bytes) -> None:
            self.data += data
            head, sep, body = self.data.partition(b"\r\n\r\n")
            if not sep:
                return
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) >= length:
                asyncio.ensure_future(stream(self.transport, json.loads(body[:length])))  # type: ignore[arg-type]

    loop = uvloop.new_event_loop()
    loop.run_until_complete(loop.create_server(Connection, "127.0.0.1", args.port))
    print("ready", flush=True)
    loop.run_forever()


if __name__ == "__main__":
    main()
