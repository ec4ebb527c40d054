"""Speculative decoding: wafer with n-gram speculation, and with a draft model, vs wafer without it,
side by side, single stream.

Three workloads, greedy, up to 256 new tokens, 2 threads, on the default model or `--model`:
- code edits: "rename an identifier in this code and give back the whole code" over three
  functions of Python's standard library, with the answer's first lines already written (the way
  editors ask for a rewrite), so the answer copies most of its input;
- coding: three requests for new code, where the answer is the model's own;
- free writing: three open prompts (a story, an essay, a letter), where little can be copied;
- tool calls: an agent's next call under its JSON Schema's grammar (as `response_format` or a tool
  call runs), after six earlier calls of the same shape in the prompt: drafts cut to what the
  grammar accepts, each verified token masked (llama-cpp-python does not run this one).
`--draft terra` adds draft-model speculation with that model (same tokenizer) proposing. Each method
runs with K fixed and with `--speculative-length adaptive` (up to K a step, as measured steps pay).
`--tree B` adds n-gram drafts as trees: the continuations of the B latest matches of the suffix
(not only the latest), merged where they agree, K nodes in all, verified in one step: its
acceptance length beside the chain's says what the other candidates add.

Decode tokens/s counts the tokens after the first over the time after the first, summed over the
prompts of a workload. Every system runs the workload once a round, in an order that turns each
round, for --repeats rounds (5): the tok/s column is a system's median over the rounds, and "vs
wafer" the median of its per-round ratios to plain decoding in the same round, with their range, so
that a host whose speed drifts during the run moves both sides of a ratio alike. Greedy output with
speculation must equal the output without it, in every round, and the script says whether it did.
llama-cpp-python's plain decode on the same prompts is printed next to them when it is installed
(`make bench` installs it).
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import inspect
import json
import os
import statistics
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import now, table  # noqa: E402
from bench.decode import THREADS  # noqa: E402
from bench.llamacpp import LlamaCpp, available, build_for  # noqa: E402

REWRITES = [
    (textwrap.TextWrapper._split, "chunks", "pieces"),
    (fnmatch.translate, "res", "out"),
    (difflib.SequenceMatcher.find_longest_match, "besti", "best_i"),
]
CODING = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that parses a CSV line with quoted fields and returns the fields.",
]
FREE = [
    "Write a long story about a dragon who learns to cook.",
    "Write an essay about why people enjoy gardening.",
    "Write a friendly letter to a friend describing your summer holiday.",
]


# An agent's calls: (tool, the JSON Schema of its arguments, the arguments of call i).
CALLS = [
    ("read_file", {"path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
     lambda i: {"path": f"src/inventory/module_{i}.py", "start_line": 1, "end_line": 40 * (i + 1)}),
    ("run_tests", {"target": {"type": "string"}, "verbose": {"type": "boolean"},
                   "keyword": {"type": "string"}},
     lambda i: {"target": f"tests/test_module_{i}.py", "verbose": True, "keyword": f"test_restock_{i}"}),
    ("replace_text", {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
     lambda i: {"path": f"src/inventory/module_{i}.py", "old": f"def total_{i}(items):",
                "new": f"def total_{i}(items: list[Item]) -> float:"}),
]


def workloads(loaded) -> dict[str, list]:
    """Per workload its prompts: token ids, or (token ids, grammar) for a reply under a grammar."""
    from llguidance import LLMatcher

    def ids(text: str) -> list[int]:
        return loaded.tokenizer.encode(text, add_special_tokens=False)

    def chat(content: str) -> str:
        return loaded.chat_template.render([{"role": "user", "content": content}], add_generation_prompt=True)

    grounded = []
    for fn, old, new in REWRITES:
        src = textwrap.dedent(inspect.getsource(fn))
        start = "\n".join(src.replace(old, new).splitlines()[:2]) + "\n"
        ask = f"Rename `{old}` to `{new}` in this code. Reply with the whole updated code.\n```python\n{src}\n```"
        grounded.append(ids(chat(ask) + "```python\n" + start))
    calls = []
    for tool, props, args in CALLS:
        schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
        shown = "\n".join(json.dumps({"tool": tool, "arguments": args(i)}) for i in range(6))
        ask = f"The calls so far:\n{shown}\nWrite the arguments of the next {tool} call, on module_6, as JSON."
        calls.append((ids(chat(ask)), LLMatcher.grammar_from_json_schema(json.dumps(schema))))
    return {"code edits": grounded, "coding": [ids(chat(p)) for p in CODING],
            "free writing": [ids(chat(p)) for p in FREE], "tool calls": calls}


def wafer_runner(loaded, spec: str, k: int, draft=None, length: str = "fixed"):
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams
    from wafer.engine.speculative.config import SpeculativeConfig

    engine = LLMEngine(loaded, EngineConfig(max_running=1, max_model_len=4096, prefix_caching=False,
                                            speculative=SpeculativeConfig.parse(spec, k, length)), draft=draft)

    def run(prompt: list[int] | tuple[list[int], str], n: int) -> tuple[list[int], float]:
        ids, grammar = prompt if isinstance(prompt, tuple) else (prompt, None)
        seq = engine.add(ids, SamplingParams(max_tokens=n, temperature=0, grammar=grammar))
        first = None
        while not seq.finished:
            engine.step()
            if first is None and seq.output_ids:
                first = now()
        return seq.output_ids, now() - first  # type: ignore[operator]

    return engine, run


class NgramTree:
    """Prompt lookup that proposes a tree: what followed each of the `branches` latest earlier
    occurrences of the longest suffix that has one (n_max down to n_min tokens), merged where they
    agree, the latest first, at most k nodes (each continuation its share of them)."""

    def __init__(self, branches: int, n_max: int = 4, n_min: int = 2) -> None:
        self.branches, self.n_max, self.n_min = branches, n_max, n_min

    def propose(self, seqs, limits):
        return [self._tree(seq.tokens, k) for seq, k in zip(seqs, limits)]

    def _tree(self, toks: list[int], k: int):
        from wafer.engine.speculative.proposer import Draft

        last = len(toks) - 1
        ends: list[int] = []
        for n in range(self.n_max, self.n_min - 1, -1):
            suffix = toks[len(toks) - n:]
            ends = [e for e in range(last - 1, n - 2, -1) if toks[e - n + 1 : e + 1] == suffix][: self.branches]
            if ends:
                break
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for i, e in enumerate(ends):
            share = k // len(ends) + (k % len(ends) if i == 0 else 0)
            parent, added = -1, 0
            for t in toks[e + 1 : min(e + 1 + k, last + 1)]:
                node = node_of.get((parent, t))
                if node is None:
                    if added >= share or len(tokens) >= k:
                        break
                    tokens.append(t)
                    parents.append(parent)
                    node = node_of[(parent, t)] = len(tokens) - 1
                    added += 1
                parent = node
        return Draft(tokens, None, parents)

    def verified(self, seq, start_len: int, accepted: int, proposed: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


def llama_cpp_run(isa: str, model: str | None = None):
    if not available(isa):
        return None
    llm = LlamaCpp(isa, n_ctx=4096, threads=THREADS, model=model)

    def run(ids: list[int], n: int) -> tuple[list[int], float]:
        r = llm.generate(ids, n)
        return r["tokens"], r["after_first"]

    return run


def rounds(runs: dict[str, Callable], prompts: list[list[int]], n: int, repeats: int,
           ) -> tuple[dict[str, list[float]], dict[str, int], dict[str, list[list[list[int]]]]]:
    """Each system over the workload once a round, the order turned by one each round: per system its
    decode tokens/s of each round, its tokens of the last round, and its outputs of every round."""
    names = list(runs)
    speeds: dict[str, list[float]] = {k: [] for k in names}
    tokens: dict[str, int] = {}
    outputs: dict[str, list[list[list[int]]]] = {k: [] for k in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            done = [runs[name](p, n) for p in prompts]
            speeds[name].append(sum(len(o) - 1 for o, _ in done) / sum(t for _, t in done))
            tokens[name] = sum(len(o) for o, _ in done)
            outputs[name].append([o for o, _ in done])
    return speeds, tokens, outputs


def ratio(speeds: list[float], base: list[float]) -> str:
    """The median of per-round ratios, and their range."""
    rs = [a / b for a, b in zip(speeds, base)]
    return f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per prompt at most")
    ap.add_argument("--k", type=int, default=8, help="speculative tokens per step (default 8)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--quant", choices=["auto", "f32", "int8", "q8", "q4"], default="auto")
    ap.add_argument("--isa", default="auto", help="wafer's kernel variant, as in bench/decode.py")
    ap.add_argument("--model", default=None, help="the target: a tier, a name of `wafer models` or a GGUF path "
                                                  "(default: the bundled SmolLM2)")
    ap.add_argument("--draft", default=None, help="also speculate with this draft model (a tier, name or path)")
    ap.add_argument("--workloads", nargs="*", default=None, help="only these workloads")
    ap.add_argument("--tree", type=int, default=0, metavar="B",
                    help="also n-gram trees of the B latest matches' continuations (0: none)")
    args = ap.parse_args()
    os.environ["WAFER_KERNELS"] = args.isa
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    from wafer.models.loader import load_model, resolve_path

    model_path = str(resolve_path(args.model))
    loaded = load_model(model_path, compute=args.quant)
    loads = workloads(loaded)
    if args.workloads:
        loads = {k: v for k, v in loads.items() if k in args.workloads}
    plain_engine, plain = wafer_runner(loaded, "off", args.k)
    from wafer.kernels import build as kernels

    variant = kernels.wanted()
    label = f"wafer {loaded.compute} ({kernels.status().variant or 'PyTorch'})"
    methods = {f"{label} + ngram k={args.k}": wafer_runner(loaded, "ngram", args.k),
               f"{label} + ngram k<={args.k} adaptive": wafer_runner(loaded, "ngram", args.k, length="adaptive")}
    if args.draft:
        draft = load_model(str(resolve_path(args.draft)), compute=args.quant)
        methods[f"{label} + draft {draft.name} k={args.k}"] = wafer_runner(loaded, f"draft:{args.draft}", args.k, draft)
        methods[f"{label} + draft {draft.name} k<={args.k} adaptive"] = wafer_runner(
            loaded, f"draft:{args.draft}", args.k, draft, length="adaptive")
    if args.tree:
        engine, run = wafer_runner(loaded, "ngram", args.k)
        engine.speculator.proposer = NgramTree(args.tree)
        methods[f"{label} + ngram tree of {args.tree} k={args.k}"] = engine, run
    lcpp = llama_cpp_run(build_for(variant), model_path)
    plain(loads[next(iter(loads))][0], 8)  # warm-up
    for _, run in methods.values():
        run(loads[next(iter(loads))][0], 8)

    rows = []
    per_position = {}
    lengths_chosen = {}
    for name, prompts in loads.items():
        runs: dict[str, Callable] = {label: plain, **{m: run for m, (_, run) in methods.items()}}
        constrained = any(isinstance(p, tuple) for p in prompts)  # under a grammar: wafer's alone
        if lcpp is not None and not constrained:
            runs["llama-cpp-python"] = lcpp
        before = {m: (e.stats.spec.drafts, e.stats.spec.accepted_tokens, list(e.stats.spec.accepted_per_pos),
                      dict(e.speculator.draft_length.chosen) if e.speculator.draft_length else None) for m, (e, _) in methods.items()}
        speeds, tokens, outputs = rounds(runs, prompts, args.tokens, args.repeats)
        base, ref = speeds[label], outputs[label][0]
        rows.append([name, label, str(tokens[label]), f"{statistics.median(base):.1f}", "-", "1.00x", "-"])
        for method, (engine, _) in methods.items():
            st = engine.stats.spec
            drafts0, accepted0, per_pos0, chosen = before[method]
            drafts, accepted = st.drafts - drafts0, st.accepted_tokens - accepted0
            per_pos = [a - b for a, b in zip(st.accepted_per_pos, per_pos0 + [0] * len(st.accepted_per_pos))]
            per_position[(name, method)] = ", ".join(f"{n / drafts:.2f}" for n in per_pos) if drafts else "-"
            if chosen is not None:
                lengths_chosen[(name, method)] = ", ".join(
                    f"{k}: {n - chosen[k]}" for k, n in engine.speculator.draft_length.chosen.items() if n > chosen[k])
            same = all(out == ref for out in outputs[method])
            rows.append([name, method, str(tokens[method]), f"{statistics.median(speeds[method]):.1f}",
                         f"{1 + accepted / drafts:.2f}" if drafts else "-", ratio(speeds[method], base),
                         "yes" if same else "NO"])
        if lcpp is not None and not constrained:
            rows.append([name, "llama-cpp-python", str(tokens["llama-cpp-python"]),
                         f"{statistics.median(speeds['llama-cpp-python']):.1f}", "-",
                         ratio(speeds["llama-cpp-python"], base), "-"])
        print(f"  measured {name}", file=sys.stderr)
    print(f"Speculative decoding, {loaded.name} ({label}), single stream, greedy, up to {args.tokens} new "
          f"tokens per prompt, {THREADS} threads, 3 prompts per workload, {args.repeats} rounds (tok/s: median; "
          f"vs wafer: median of per-round ratios, and their range)")
    print(table(["workload", "system", "tokens", "decode tok/s", "acceptance length", "vs wafer", "same output"],
                rows))
    print("acceptance rate by draft position (accepted / proposals at positions 1..k):")
    for (name, method), text in per_position.items():
        print(f"  {name}, {method}: {text}")
    if lengths_chosen:
        print("draft lengths the adaptive runs chose (length: steps):")
        for (name, method), text in lengths_chosen.items():
            print(f"  {name}, {method}: {text}")


if __name__ == "__main__":
    main()
