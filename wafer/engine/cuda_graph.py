"""Decode steps replayed from CUDA graphs, as vLLM and nano-vllm do.

On a GPU a decode step of a small batch is hundreds of kernel launches whose CPU cost exceeds their
GPU time; a CUDA graph launches them all at once. A graph fixes its shapes, so a step here is the
model's ordinary forward over static buffers: attention reads the first L positions of each
sequence's blocks (its table row, copied into a static buffer) under a mask built on the device
from the positions
(AttentionBatch.static_decode). Each pair of a batch size bucket (1, 2, 4, 8, 16, 24, 32, 64, ...)
and a context bucket L (256, 512, 1024, ... up to the cache's capacity) has its own graph, so a
short context does not pay for the whole capacity. A smaller batch is padded by repeating its first
token, which writes the same key and value to the same place again.

Where CUDA is absent the same class runs the same static forward eagerly (capture=False), so the
logic is tested on the CPU against the ordinary path.
"""

from __future__ import annotations

import torch

from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK
from wafer.models.attention import AttentionBatch
from wafer.models.llama import LlamaModel


def buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 8 if sizes[-1] < 32 else sizes[-1] * 2)
    return [b for b in sizes if b < max_batch] + [max_batch]


def length_buckets(max_len: int, smallest: int = 256) -> list[int]:
    lengths = []
    while smallest < max_len:
        lengths.append(smallest)
        smallest *= 2
    return lengths + [max_len]


class GraphedDecode:
    def __init__(self, model: LlamaModel, kv: KVCache, max_batch: int,
                 capture: bool | None = None, min_length: int = 256) -> None:
        self.model = model
        self.kv = kv
        self.caches = kv.layers
        self.max_len = kv.blocks.max_len
        device = kv.device
        self.max_batch = max_batch
        self.sizes = buckets(max_batch)
        self.lengths = length_buckets(self.max_len, min_length)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.tables = torch.zeros(kv.blocks.tables.shape[0], max_batch, kv.blocks.max_blocks, dtype=torch.long,
                                  device=device)
        self.capture = device.type == "cuda" if capture is None else capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        if self.capture:
            self._capture_all()

    def _forward(self, n: int, length: int) -> torch.Tensor:
        batch = AttentionBatch.static_decode(self.tables[:, :n, : -(-length // BLOCK)], self.positions[:n], BLOCK,
                                             self.kv.blocks.window_group)
        return self.model(self.ids[:n], self.positions[:n], batch, self.caches)

    def _capture_all(self) -> None:
        # Warm-up on a side stream first (cuBLAS picks its algorithms and workspaces outside the
        # capture), largest graph first so that the smaller ones reuse its memory pool.
        shapes = [(n, length) for n in reversed(self.sizes) for length in reversed(self.lengths)]
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for shape in shapes:
                self._forward(*shape)
        torch.cuda.current_stream().wait_stream(stream)
        for shape in shapes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[shape] = self._forward(*shape)
            pool = graph.pool() if pool is None else pool
            self.graphs[shape] = graph
        torch.cuda.synchronize()

    def __call__(self, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] for one token each of distinct sequences."""
        n = len(ids)
        shape = (next(s for s in self.sizes if s >= n), next(L for L in self.lengths if L > max(positions)))
        pad = shape[0] - n  # rows repeating the first token: same key and value, same place
        for buf, values in ((self.ids, ids), (self.positions, positions)):
            buf[: shape[0]].copy_(torch.tensor(values + values[:1] * pad, dtype=torch.long), non_blocking=True)
        self.tables[:, : shape[0]].copy_(self.kv.blocks.tables[:, slots + slots[:1] * pad], non_blocking=True)
        if not self.capture:
            return self._forward(*shape)[:n]
        self.graphs[shape].replay()
        return self.outputs[shape][:n]
