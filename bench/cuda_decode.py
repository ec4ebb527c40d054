"""`bench/decode.py --device cuda`: single-stream decode of a Llama-3.1-8B-shaped model with random
bfloat16 weights on a GPU, through wafer's runner: eager PyTorch vs the same steps replayed from
CUDA graphs, side by side in one run, with the memory bandwidth each achieves against the device's
peak (4.8 TB/s for an H200). Random weights: speed does not depend on their values, and no
checkpoint can be downloaded here.

`--shape tiny --device cpu` runs the same code on a tiny model, to check the script without a GPU.
"""

from __future__ import annotations

import statistics

import torch

from bench.common import now, table
from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import bytes_per_token
from wafer.engine.model_runner import ModelRunner
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import SamplingParams, Sequence
from wafer.models.config import ModelConfig
from wafer.models.llama import LlamaModel, Rotary

SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32),
}
PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e


def random_model(shape: str, device: str, dtype: torch.dtype) -> LlamaModel:
    cfg = ModelConfig(arch="llama", max_position_embeddings=8192, rms_norm_eps=1e-5, name=f"{shape} (random)",
                      **SHAPES[shape])  # type: ignore[arg-type]
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.rotary = Rotary(cfg).to(device=device, dtype=dtype)
    return model.eval()


def decode(runner: ModelRunner, kv: KVCache, prompt: list[int], n: int) -> tuple[float, float]:
    """(TTFT s, decode tokens/s) for one greedy sequence of n new tokens."""
    seq = Sequence(list(prompt), SamplingParams(max_tokens=n))
    seq.slot, _ = kv.blocks.allocate()
    sync = torch.cuda.synchronize if kv.layers[0][0].is_cuda else (lambda: None)
    sync()
    t0 = now()
    logits = runner.run([ScheduledSeq(seq, 0, len(prompt))])
    seq.tokens.append(int(logits[0].argmax()))
    seq.num_cached = len(prompt)
    first = now()
    for _ in range(n - 1):
        logits = runner.run([ScheduledSeq(seq, seq.num_cached, 1)])  # logits come back to the host
        seq.tokens.append(int(logits[0].argmax()))
        seq.num_cached += 1
    sync()
    end = now()
    kv.blocks.free(seq.slot)
    return first - t0, (n - 1) / (end - first)


def main(args) -> None:  # type: ignore[no-untyped-def]
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(args.shape, device, dtype)
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = KVCache.for_model(model, 1, 64 + len(prompt) + args.tokens)
    systems = {"wafer eager": ModelRunner(model, kv, cuda_graphs=False), "wafer CUDA graphs": ModelRunner(model, kv)}
    for runner in systems.values():
        decode(runner, kv, prompt, 8)  # warm-up
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, runner in systems.items():
            results[name].append(decode(runner, kv, prompt, args.tokens))
    # Bytes one decode step reads: every weight but the embedding table (one row of it), and the KV
    # cache up to the middle of the generation.
    weights = sum(p.numel() * p.element_size() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    kv_bytes = bytes_per_token(cfg, kv.layers[0][0].dtype) * (len(prompt) + args.tokens // 2)
    step_bytes = weights + kv_bytes
    name0 = next(iter(systems))
    base = statistics.median(r[1] for r in results[name0])
    rows = []
    for name, runs in results.items():
        tps = statistics.median(r[1] for r in runs)
        ttft = statistics.median(r[0] for r in runs)
        bw = step_bytes * tps
        rows.append([name, f"{tps:.1f}", f"{ttft * 1000:.1f}", f"{bw / 1e9:.0f}", f"{bw / PEAK_BYTES_PER_S:.1%}",
                     f"{tps / base:.2f}x"])
    print(f"Single-stream decode on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
          f"{cfg.name}, {str(dtype).removeprefix('torch.')}, {weights / 1e9:.2f} GB of weights read per token, "
          f"{len(prompt)}-token prompt, greedy, {args.tokens} new tokens, median of {args.repeats}")
    print(table(["system", "decode tok/s", f"TTFT {len(prompt)}-tok ms", "achieved GB/s", "of 4.8 TB/s",
                 f"vs {name0}"], rows))
