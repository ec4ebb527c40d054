"""Single-stream decode speed: wafer (each CPU compute path) vs llama-cpp-python (when installed) vs transformers.

Same GGUF, same chat prompt, greedy, EOS suppressed, 256 new tokens, 2 threads; one warm-up run,
then the median of 5, the repeats taken round-robin over the systems. Decode tokens/s counts the tokens after the first, over the time after the
first; TTFT is the time to the first token.

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


def wafer_runner(n_new: int, compute: str = "f32", ignore_eos: bool = False):
    """(prompt_ids, run): run(ids, n) decodes greedily and returns (TTFT s, decode tok/s). EOS is
    suppressed by logit bias, as llama-cpp-python's run does, or with ignore_eos as an HTTP
    request asks for it."""
    from wafer.engine.engine import EngineConfig, LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.models.loader import load_model

    loaded = load_model(compute=compute)
    # No prefix cache: every run prefills its whole prompt, as llama-cpp-python's reset=True does.
    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=2048, prefix_caching=False))
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


def load_llama_cpp(n_ctx: int = 2048):
    """llama-cpp-python on the bundled GGUF with this script's threads, or None when not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from wafer.models.loader import default_model_path

    return Llama(str(default_model_path()), n_ctx=n_ctx, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)


def llama_cpp_runner(n_new: int):
    llm = load_llama_cpp()
    if llm is None:
        return None
    eos = llm.token_eos()

    def run(ids: list[int], n: int = n_new) -> tuple[float, float]:
        llm.reset()
        t0 = now()
        first = None
        count = 0
        for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True, logits_processor=[lambda _i, s: _suppress(s, eos)]):
            count += 1
            if first is None:
                first = now()
            if count >= n:
                break
        end = now()
        return first - t0, (n - 1) / (end - first)

    return run


def _suppress(scores, eos):
    scores[eos] = -1e9
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long-prompt", type=int, default=1024, help="tokens in the long-prompt TTFT case")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: a random Llama-3.1-8B-shaped model on the GPU, eager vs CUDA graphs")
    ap.add_argument("--shape", choices=["llama-3.1-8b", "tiny"], default=None,
                    help="model shape of the random-weights run (default llama-3.1-8b; tiny checks the script)")
    args = ap.parse_args()
    if args.device == "cuda" or args.shape:
        from bench.cuda_decode import main as cuda_main

        args.shape = args.shape or "llama-3.1-8b"
        return cuda_main(args)
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

    prompt_ids, wafer_run = wafer_runner(args.tokens)
    ids = prompt_ids(PROMPT)
    filler = " ".join(["The lighthouse stood on the rocky shore and watched the sea."] * 200)
    long_ids = prompt_ids(filler)[: args.long_prompt - 8] + ids[-8:]
    # q4 is what `--quant auto` (the default) runs for the bundled Q4_1 file.
    systems: dict[str, object] = {"wafer --quant f32": wafer_run, "wafer --quant int8": wafer_runner(args.tokens, "int8")[1],
                                  "wafer --quant q8": wafer_runner(args.tokens, "q8")[1],
                                  "wafer --quant q4 (auto)": wafer_runner(args.tokens, "q4")[1]}
    _, hf_run = hf_runner(args.tokens)
    systems["transformers"] = hf_run
    lc = llama_cpp_runner(args.tokens)
    if lc is not None:
        systems["llama-cpp-python"] = lc

    # Repeats go round-robin over the systems, so that a slow spell of this shared machine hits
    # every system alike instead of whichever ran during it.
    for run in systems.values():
        run(ids, 8)  # warm-up
    decode: dict[str, list[float]] = {name: [] for name in systems}
    short: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, run in systems.items():
            decode[name].append(run(ids)[1])
            short[name].append(run(ids, 1)[0])
    results: dict[str, tuple[float, float, float]] = {}
    for name, run in systems.items():
        results[name] = (statistics.median(decode[name]), statistics.median(short[name]), run(long_ids, 1)[0])
        print(f"  measured {name}", file=sys.stderr)

    print(f"Single-stream decode, default model, {len(ids)}-token chat prompt, greedy, EOS suppressed, "
          f"{args.tokens} new tokens, {THREADS} threads, median of {args.repeats}")
    # Ratios against llama-cpp-python when it ran (the baseline), else against wafer f32.
    base_name = "llama-cpp-python" if "llama-cpp-python" in results else "wafer --quant f32"
    base_dec, _, base_long = results[base_name]
    rows = []
    for name, (dec, t1, t2) in results.items():
        rows.append([name, f"{dec:.1f}", f"{t1 * 1000:.0f}", f"{t2 * 1000:.0f}", f"{dec / base_dec:.2f}x",
                     f"{t2 / base_long:.2f}x"])
    print(table(["system", "decode tok/s", f"TTFT {len(ids)}-tok ms", f"TTFT {len(long_ids)}-tok ms",
                 f"decode vs {base_name}", f"TTFT {len(long_ids)} vs {base_name}"], rows))


if __name__ == "__main__":
    main()
