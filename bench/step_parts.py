"""Two parts of a decode step, each against what it replaced, side by side in one run.

- Weights on 2 MB pages: single-stream decode tokens/s of the default model (q4) with its block
  weights in the buffer wafer makes (`onto_huge_pages`, advised MADV_HUGEPAGE) against the same
  buffer left on 4 KB pages. Two engines, run alternately, each run's ratio to the other engine's
  run next to it; the median of those.
- The greedy pick: wafer's `argmax_rows` against `torch.max(dim=-1)` on rows of the vocabulary's
  length, for 1, 16 and 64 rows (decode batches), warm, the median of repeated calls.
- Sampling at the models' own defaults (SmolLM2's temperature 0.2 and top-p 0.9, Qwen2.5's 0.7, 0.8
  and top-k 20, and plain temperature 1): the Sampler's batched draw among candidates against a row
  at a time over the whole vocabulary (`sample_row`, what every sampled row cost before), both with
  torch finding the candidates, and the batched draw with wafer's `top_candidates` finding them, on
  the default model's own logits for 1, 16 and 64 rows, and on rows of Qwen2.5's vocabulary size.
- Sampled decoding, whole (`--sampled MODEL,...`, e.g. luna,terra): a model's decode step at its
  own default sampling with 16 streams, and n-gram speculation on a code edit with one, the sampler
  finding its candidates with wafer's kernel against torch's way (the kernels switched off for the
  sampler alone); one engine, the two run alternately, medians over the rounds; whether the outputs
  were the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import table  # noqa: E402
from bench.decode import THREADS  # noqa: E402
from bench.server_decode import engine_runner  # noqa: E402
from wafer.kernels.build import kernels, status  # noqa: E402
from wafer.models.blockquant import onto_huge_pages  # noqa: E402
from wafer.models.loader import load_model  # noqa: E402
from wafer.models.quant import BlockLinear  # noqa: E402


def mapping(ptr: int) -> tuple[list[str], int]:
    """The VmFlags and the kB on 2 MB pages (AnonHugePages, or FilePmdMapped for records mapped from
    their cache file) of the mapping that holds address `ptr`."""
    inside, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside, huge = lo <= ptr < hi, 0
        elif inside and line.startswith(("AnonHugePages:", "FilePmdMapped:")):
            huge += int(line.split()[1])
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:], huge
    raise LookupError(hex(ptr))


def pages(rounds: int, tokens: int) -> list[list[str]]:
    on_huge = load_model(compute="q4")
    on_small = load_model(compute="q4")
    blocks = [m for m in on_small.model.modules() if isinstance(m, BlockLinear)]
    for m, packed in zip(blocks, onto_huge_pages([m.packed for m in blocks], advise=False)):
        m.packed = packed
    huge = mapping(next(m for m in on_huge.model.modules() if isinstance(m, BlockLinear)).packed.data_ptr())
    small = mapping(blocks[0].packed.data_ptr())
    if "hg" in small[0] or small[1]:
        raise SystemExit("the 4 KB baseline got huge pages anyway")
    print(f"wafer's buffer: {huge[1] // 1024} MB on 2 MB pages")
    runs = {"2 MB pages (wafer)": engine_runner("q4", on_huge), "4 KB pages": engine_runner("q4", on_small)}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run(16)  # warm-up
    for r in range(rounds):
        for key in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            runs[key](8)  # a short request first, as in bench/server_decode.py
            rates[key].append(runs[key](tokens).request_rate())
    base = rates["4 KB pages"]
    return [[k, f"{statistics.median(v):.1f}", f"{statistics.median(a / b for a, b in zip(v, base)):.3f}x"]
            for k, v in rates.items()]


def median_seconds(fn, warm: int, calls: int) -> float:  # type: ignore[no-untyped-def]
    """The median time of `calls` calls of fn, after `warm` calls."""
    for _ in range(warm):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def argmax(vocab: int) -> list[list[str]]:
    ext = kernels()
    rows = []
    for m in (1, 16, 64):
        x = torch.randn(m, vocab)
        if not torch.equal(ext.argmax_rows(x), x.max(dim=-1).indices):
            raise SystemExit("argmax_rows disagrees with torch.max")
        times = {}
        for name, fn in (("torch.max", lambda x=x: x.max(dim=-1).indices), ("argmax_rows", lambda x=x: ext.argmax_rows(x))):
            times[name] = median_seconds(fn, 20, 200) * 1e6
        rows.append([str(m), f"{times['torch.max']:.1f}", f"{times['argmax_rows']:.1f}",
                     f"{times['torch.max'] / times['argmax_rows']:.2f}x"])
    return rows


def model_logits(rows: int) -> torch.Tensor:
    """The default model's logits at the last `rows` positions of a held text."""
    from bench.quality import corpus_ids
    from wafer.engine.kv_cache import KVCache
    from wafer.engine.model_runner import ModelRunner
    from wafer.engine.scheduler import ScheduledSeq
    from wafer.engine.sequence import SamplingParams, Sequence

    loaded = load_model(compute="q4")
    ids = corpus_ids(loaded.tokenizer, rows + 16)
    kv = KVCache(loaded.config, 1, len(ids), dtype=torch.float32)
    seq = Sequence(ids, SamplingParams())
    seq.slot, _ = kv.blocks.allocate(None)
    kv.blocks.reserve(seq.slot, len(ids))
    with torch.inference_mode():
        return ModelRunner(loaded.model, kv).run([ScheduledSeq(seq, 0, len(ids))], all_logits=True)[-rows:].clone()


def sampling(logits: torch.Tensor) -> list[list[str]]:
    from wafer.engine import sampler as sampler_module
    from wafer.engine.sampler import Sampler
    from wafer.engine.sequence import SamplingParams, Sequence

    settings = {"t 0.2, top-p 0.9": dict(temperature=0.2, top_p=0.9),
                "t 0.7, top-p 0.8, top-k 20": dict(temperature=0.7, top_p=0.8, top_k=20),
                "t 1.0": dict(temperature=1.0)}
    ours = sampler_module.kernels
    rows = []
    for name, kw in settings.items():
        for m in (1, 16, 64):
            seqs = [Sequence([1], SamplingParams(seed=i, **kw)) for i in range(m)]
            sampler = Sampler(0)
            fns = {"row by row": (lambda: None, lambda: [sampler.sample_row(logits[i], s) for i, s in enumerate(seqs)]),
                   "batched": (lambda: None, lambda: sampler(logits[:m].clone(), seqs)),
                   "kernel": (ours, lambda: sampler(logits[:m].clone(), seqs))}
            times = {}
            with torch.inference_mode():
                try:
                    for key, (finder, fn) in fns.items():
                        sampler_module.kernels = finder  # None: torch finds the candidates
                        times[key] = median_seconds(fn, 3, 15) * 1e3
                finally:
                    sampler_module.kernels = ours
            rows.append([name, str(m), f"{times['row by row']:.2f}", f"{times['batched']:.2f}", f"{times['kernel']:.2f}",
                         f"{times['row by row'] / times['batched']:.1f}x", f"{times['batched'] / times['kernel']:.1f}x"])
    return rows


def sampled(model: str, rounds: int) -> list[list[str]]:
    """[model, what, torch's way, the kernel's, speed-up, same outputs] for 16 streams' decode steps
    (ms a step) and n-gram speculation (tokens/s), each at the model's own default sampling."""
    import random

    from wafer.engine import sampler as sampler_module
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.engine.speculative.config import SpeculativeConfig
    from wafer.models.generation_defaults import NEUTRAL

    loaded = load_model(model, compute="auto")
    defaults = {**NEUTRAL, **loaded.sampling}  # what the server gives a request that sets none
    ours = sampler_module.kernels
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(500)]
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(40))
    edit = loaded.tokenizer.encode(loaded.chat_template.render(
        [{"role": "user", "content": "Rename every function f to g in this code and print it whole:\n" + code}],
        add_generation_prompt=True), add_special_tokens=False)
    plain = LLMEngine(loaded, EngineConfig(max_running=16, max_model_len=4096))
    spec = LLMEngine(loaded, EngineConfig(max_running=4, max_model_len=4096,
                                          speculative=SpeculativeConfig(method="ngram", num_tokens=5, adaptive=False)))

    def streams() -> tuple[float, list]:
        seqs = [plain.add(prompt, SamplingParams(max_tokens=24, seed=i, ignore_eos=True, **defaults)) for i in range(16)]
        while not all(q.output_ids for q in seqs):
            plain.step()
        t, n = time.perf_counter(), 0
        while not all(q.finished for q in seqs):
            plain.step()
            n += 1
        return (time.perf_counter() - t) / n * 1e3, [q.output_ids for q in seqs]

    def speculated() -> tuple[float, list]:
        q = spec.add(edit, SamplingParams(max_tokens=160, seed=1, ignore_eos=True, **defaults))
        while not q.output_ids:
            spec.step()
        t, before = time.perf_counter(), len(q.output_ids)
        while not q.finished:
            spec.step()
        return (len(q.output_ids) - before) / (time.perf_counter() - t), q.output_ids

    rows = []
    for what, fn, unit in (("16 streams, ms a step", streams, "ms"), ("n-gram on a code edit, tokens/s", speculated, "tok/s")):
        got: dict[str, list[float]] = {"torch": [], "kernel": []}
        outs: dict[str, list] = {"torch": [], "kernel": []}
        try:
            for r in range(rounds):
                for way in (("torch", "kernel") if r % 2 == 0 else ("kernel", "torch")):
                    sampler_module.kernels = ours if way == "kernel" else (lambda: None)
                    value, out = fn()
                    got[way].append(value)
                    outs[way].append(out)
        finally:
            sampler_module.kernels = ours
        a, b = statistics.median(got["torch"]), statistics.median(got["kernel"])
        rows.append([model, what, f"{a:.2f}", f"{b:.2f}", f"{a / b if unit == 'ms' else b / a:.2f}x",
                     "yes" if outs["torch"] == outs["kernel"] else "NO"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--skip-pages", action="store_true", help="leave out the decode runs (minutes)")
    ap.add_argument("--sampled", default="", metavar="MODEL,...",
                    help="also sampled decoding with these models (a minute or more each), e.g. luna,terra")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    torch.set_num_threads(THREADS)
    if kernels() is None:
        raise SystemExit(f"wafer's kernels do not run: {status().problem}")
    if not args.skip_pages:
        print(f"Single-stream decode, default model (q4), {args.tokens} new tokens, greedy, EOS ignored, {THREADS} "
              f"threads, {args.rounds} runs each, alternating; ratio: median of each run's over the 4 KB run beside it")
        print(table(["block weights on", "tok/s", "vs 4 KB pages"], pages(args.rounds, args.tokens)))
    print(f"\nGreedy pick over rows of {49152} logits, median of 200 calls, {THREADS} threads")
    print(table(["rows", "torch.max us", "argmax_rows us", "speed-up"], argmax(49152)))
    head = ["settings", "rows", "row by row ms", "batched ms", "batched, top_candidates ms", "batched vs row by row",
            "top_candidates vs torch's"]
    logits = model_logits(64)
    print(f"\nSampling rows of the default model's logits ({logits.shape[1]} tokens), median of 15 calls, {THREADS} "
          "threads; the first two find the candidates with torch")
    print(table(head, sampling(logits)))
    # Qwen2.5's vocabulary: the default model's rows repeated, so that the distributions are a model's.
    wide = logits.repeat(1, 4)[:, :151936].contiguous()
    print(f"\nThe same on rows of {wide.shape[1]} logits (Qwen2.5's vocabulary size; the default model's, repeated)")
    print(table(head, sampling(wide)))
    if args.sampled:
        print(f"\nSampled decoding at each model's default sampling, {THREADS} threads, "
              f"{args.rounds} rounds alternating; the candidates by torch's way and by top_candidates")
        rows = [row for m in args.sampled.split(",") for row in sampled(m.strip(), args.rounds)]
        print(table(["model", "measure", "torch's way", "top_candidates", "speed-up", "same outputs"], rows))


if __name__ == "__main__":
    main()
