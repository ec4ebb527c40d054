"""Single-stream decode speed and time to first token: wafer's default path on a kernel variant vs
llama-cpp-python built for the same instruction sets, in one run.

Same GGUF, same chat prompt, greedy, EOS suppressed, 256 new tokens, 2 threads; one warm-up run, then
the median of 5, the repeats taken round-robin over the systems. Decode tokens/s counts the tokens
after the first, over the time after the first; TTFT is the time to the first token, for the chat
prompt and for a 1024-token prompt. Then wafer's aggregate rate with 16 sequences decoding together
(128 tokens each, once a round, against that round's single stream), the bytes a decode step reads,
and the GB/s that makes against this machine's read bandwidth, measured in every round beside the
decode runs (a shared host's bandwidth moves as much as its decoding does).

`--isa avx2`: wafer's AVX2 variant against llama.cpp built for AVX2 only (as on a CPU without
AVX-512), whatever this CPU has; the default is the best variant against llama.cpp built for every
instruction set of this CPU (`make bench` builds both; bench/llamacpp.py runs them).
`--device cuda`: a Llama-3.1-8B-shaped model with random weights on the GPU instead (cuda_decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import PROMPT, now, table  # noqa: E402

THREADS = 2


def wafer_runner(n_new: int, compute: str = "f32", ignore_eos: bool = False, loaded=None, max_model_len: int = 2048):
    """(prompt_ids, run): run(ids, n) decodes greedily and returns (TTFT s, decode tok/s). EOS is
    suppressed by logit bias, as llama-cpp-python's run does, or with ignore_eos as an HTTP
    request asks for it."""
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model

    loaded = loaded or load_model(compute=compute)
    # No prefix cache: every run prefills its whole prompt, as llama-cpp-python's reset=True does.
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=max_model_len, prefix_caching=False))
    tok = loaded.tokenizer

    def prompt_ids(text: str) -> list[int]:
        return tok.encode(loaded.chat_template.render([{"role": "user", "content": text}]), add_special_tokens=False)

    def run(ids: list[int], n: int = n_new) -> tuple[float, float]:
        params = (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) if ignore_eos else
                  SamplingParams(max_tokens=n, temperature=0, logit_bias={e: -1e9 for e in tok.eos_ids}))
        t0 = now()
        seq = engine.add(ids, params)
        first = None
        while not seq.finished:
            engine.step()
            if first is None and seq.output_ids:
                first = now()
        end = now()
        assert len(seq.output_ids) == n
        return first - t0, (n - 1) / (end - first)

    return prompt_ids, run


def hf_runner(n_new: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wafer.models.loader import default_model_path

    p = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)

    def run(ids: list[int], n: int = n_new) -> tuple[float, float]:
        x = torch.tensor([ids])
        t0 = now()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = now() - t0
        t0 = now()
        model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = now() - t0
        return ttft, (n - 1) / max(total - ttft, 1e-9)

    return tok, run


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("model name", "Model")):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of the fastest read-only pass over `gib` GiB (larger than any cache here) with this
    script's threads, a float32 sum or a float32 GEMV: the most a decode step that reads its weights
    once can stream."""
    n = int((gib * 2**30 / 4) ** 0.5)
    w, v = torch.ones(n, n), torch.ones(n)
    best = float("inf")
    for _ in range(repeats):
        for f in (lambda: w.sum(), lambda: torch.mv(w, v)):
            t0 = now()
            f()
            best = min(best, now() - t0)
    return n * n * 4 / best / 1e9


def step_bytes(loaded) -> int:
    """Bytes one decode step of one sequence reads from memory: every weight of the blocks and the
    head in the compute path's own format, the norms, and one row of the embedding (the KV cache of a
    short context adds under 1%)."""
    from wafer.models.quant import BlockLinear, Int8Linear

    total = 0
    for mod in loaded.model.modules():
        if isinstance(mod, BlockLinear):
            total += mod.packed.numel()
        elif isinstance(mod, Int8Linear):
            total += mod.qweight.numel() + mod.scales.numel() * 2
        elif isinstance(mod, torch.nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
        elif type(mod).__name__ == "RMSNorm":
            total += mod.weight.numel() * 4
    return total + loaded.config.hidden_size * 4


def concurrent(loaded, n_seqs: int, prompt: list[int], n_new: int) -> float:
    """Aggregate decode tokens/s of n_seqs sequences decoding together (after each one's first token)."""
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(max_running=n_seqs, max_model_len=2048, prefix_caching=False))
    seqs = [engine.add(prompt, SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)) for _ in range(n_seqs)]
    while not all(s.output_ids for s in seqs):
        engine.step()
    t0, done = now(), sum(len(s.output_ids) for s in seqs)
    while not all(s.finished for s in seqs):
        engine.step()
    return (sum(len(s.output_ids) for s in seqs) - done) / (now() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="auto",
                    help="wafer's kernel variant (auto: the best this CPU runs; avx2: the AVX2 variant against "
                         "llama.cpp built for AVX2 only; any name of wafer/kernels/build.py)")
    ap.add_argument("--model", default=None,
                    help="a model of `wafer models` by name or tier (sol, terra, luna), or a GGUF path "
                         "(default: the bundled SmolLM2)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long-prompt", type=int, default=1024, help="tokens in the long-prompt TTFT case")
    ap.add_argument("--concurrency", type=int, default=16, help="sequences decoding together in the batch row")
    ap.add_argument("--paths", action="store_true", help="also wafer's f32, int8 and q8 paths, and transformers")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: a random Llama-3.1-8B-shaped model on the GPU, eager vs CUDA graphs")
    ap.add_argument("--shape", choices=["llama-3.1-8b", "tiny"], default=None,
                    help="model shape of the random-weights run (default llama-3.1-8b; tiny checks the script)")
    args = ap.parse_args()
    if args.device == "cuda" or args.shape:
        from bench.cuda_decode import main as cuda_main

        args.shape = args.shape or "llama-3.1-8b"
        return cuda_main(args)
    os.environ["WAFER_KERNELS"] = args.isa  # read once, when the kernels are first asked for
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    from bench.llamacpp import LlamaCpp, available, build_for
    from wafer.kernels import build as kernels
    from wafer.models.loader import load_model

    variant = kernels.wanted()
    lc_isa = build_for(variant)
    from wafer.models.loader import resolve_path

    model_path = str(resolve_path(args.model))
    loaded = load_model(model_path, compute="auto")
    assert kernels.status().variant == variant, kernels.status()
    prompt_ids, wafer_run = wafer_runner(args.tokens, loaded=loaded)
    ids = prompt_ids(PROMPT)
    filler = " ".join(["The lighthouse stood on the rocky shore and watched the sea."] * 200)
    long_ids = prompt_ids(filler)[: args.long_prompt - 8] + ids[-8:]
    main_name = f"wafer {loaded.compute} ({variant})"
    systems: dict[str, object] = {main_name: wafer_run}
    if args.paths:
        for path in ("f32", "int8", "q8"):
            systems[f"wafer {path}"] = wafer_runner(args.tokens, path)[1]
        systems["transformers"] = hf_runner(args.tokens)[1]
    lc = None
    if available(lc_isa):
        lc = LlamaCpp(lc_isa, n_ctx=2048, threads=THREADS, model=model_path)

        def lc_run(prompt: list[int], n: int = args.tokens) -> tuple[float, float]:
            r = lc.generate(prompt, n, stop_at_eos=False)  # type: ignore[union-attr]
            assert len(r["tokens"]) == n
            return r["ttft"], (n - 1) / r["after_first"] if n > 1 else 0.0

        systems[f"llama-cpp-python ({lc_isa} build)"] = lc_run
    else:
        print(f"llama-cpp-python's {lc_isa} build is missing: make bench builds it (bench/build_llama_cpp.py)",
              file=sys.stderr)

    # Repeats go round-robin over the systems, so that a slow spell of this shared machine hits
    # every system alike instead of whichever ran during it.
    for run in systems.values():
        run(ids, 8)  # warm-up
    decode: dict[str, list[float]] = {name: [] for name in systems}
    short: dict[str, list[float]] = {name: [] for name in systems}
    long: dict[str, list[float]] = {name: [] for name in systems}
    # The batch runs in every round too, and is compared with the single stream of its own round.
    batches: list[float] = []
    ratios: list[float] = []
    # The read bandwidth too, in every round: this host's moves with its load as much as decoding does.
    bandwidths: list[float] = []
    for _ in range(args.repeats):
        for name, run in systems.items():
            decode[name].append(run(ids)[1])
            short[name].append(run(ids, 1)[0])
        bandwidths.append(read_bandwidth())
        batches.append(concurrent(loaded, args.concurrency, ids, 128))
        ratios.append(batches[-1] / decode[main_name][-1])
    for _ in range(3):
        for name, run in systems.items():
            long[name].append(run(long_ids, 1)[0])
    bandwidth = statistics.median(bandwidths)
    nbytes = step_bytes(loaded)

    def share(name: str, step: int) -> str:
        """The median of the rounds' GB/s over the bandwidth measured in the same round, and their range."""
        each = [step * tok / 1e9 / bw for tok, bw in zip(decode[name], bandwidths)]
        return f"{statistics.median(each):.0%} ({min(each):.0%} to {max(each):.0%})"

    med = {name: (statistics.median(decode[name]), statistics.median(short[name]), statistics.median(long[name]))
           for name in systems}
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {kernels.features_line()}")
    print(f"wafer kernels: {variant}" + (f"; llama.cpp {lc_isa} build: {lc.system_info.strip()}" if lc else ""))
    print(f"Single-stream decode, {loaded.name}, {len(ids)}-token chat prompt, greedy, EOS suppressed, {args.tokens} "
          f"new tokens, {THREADS} threads, median of {args.repeats} (TTFT of {len(long_ids)} tokens: median of 3)")
    base_name = next((n for n in systems if n.startswith("llama-cpp")), main_name)
    base_dec, _, base_long = med[base_name]
    rows = []
    for name, (dec, t1, t2) in med.items():
        rows.append([name, f"{dec:.1f}", f"{t1 * 1000:.0f}", f"{t2 * 1000:.0f}", f"{dec / base_dec:.2f}x",
                     f"{t2 / base_long:.2f}x"])
    print(table(["system", "decode tok/s", f"TTFT {len(ids)}-tok ms", f"TTFT {len(long_ids)}-tok ms",
                 f"decode vs {base_name}", f"TTFT {len(long_ids)} vs {base_name}"], rows))
    single = med[main_name][0]
    print(f"{main_name}: {args.concurrency} sequences together decode {statistics.median(batches):.1f} tokens/s in all, "
          f"{statistics.median(ratios):.2f}x its single stream (the median of {args.repeats} rounds' ratios, each to "
          f"the single stream of its own round; {min(ratios):.2f}x to {max(ratios):.2f}x)")
    print(f"{main_name}: a decode step reads {nbytes / 1e6:.1f} MB; at {single:.1f} tokens/s that is "
          f"{nbytes * single / 1e9:.1f} GB/s, {share(main_name, nbytes)} of this machine's measured read bandwidth "
          f"(each round's decode to the bandwidth measured in that round, a float32 sum or GEMV over 1 GiB; median "
          f"{bandwidth:.1f} GB/s, {min(bandwidths):.1f} to {max(bandwidths):.1f}, which allows "
          f"{bandwidth * 1e9 / nbytes:.0f} tokens/s)")
    if lc:
        lc_bytes = gguf_step_bytes(model_path)
        lc_dec = med[base_name][0]
        print(f"{base_name}: a decode step reads {lc_bytes / 1e6:.1f} MB (the file's tensors but the embedding table); at "
              f"{lc_dec:.1f} tokens/s that is {lc_bytes * lc_dec / 1e9:.1f} GB/s, "
              f"{share(base_name, lc_bytes)} of the measured read bandwidth")
        lc.close()


def gguf_step_bytes(path: str) -> int:
    """Bytes llama.cpp reads for one decode step: every tensor of the file as stored, except the
    token embedding table, of which it reads one row (unless the head shares it)."""
    from wafer.models.gguf_reader import GGUFHeader

    header = GGUFHeader(Path(path))
    tied = not any(t.name == "output.weight" for t in header.tensors)
    return sum(t.n_bytes for t in header.tensors if t.name != "token_embd.weight" or tied)


if __name__ == "__main__":
    main()
