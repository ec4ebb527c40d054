"""Tool calls that are right: the Berkeley Function Calling Leaderboard (BFCL v4) per tier, beside
llama.cpp's `llama-server --jinja` on the same GGUFs, each case scored by BFCL's own AST checker.

    python bench/bfcl.py --limit 10                      # wafer's three tiers, llama-server on sol and terra
    python bench/bfcl.py --tiers sol --grammar both      # sol with the tool grammar on and off
    python bench/bfcl.py --endpoint http://host:8000/v1 --model NAME   # any OpenAI-compatible server

The cases, the answers and the checker come from the `bfcl-eval` package (installed with `--no-deps`
into .venv/bfcl by `make bench`: its full dependency set would replace pinned packages, numpy among
them, and pull in a dozen vendor SDKs; the checker itself needs none of them). Each case is sent as
BFCL sends it to a function-calling model through the OpenAI API (its FC handler): the question's
messages, the functions as `tools` (BFCL's types mapped to JSON Schema's, `.` in names written `_`),
`tool_choice` auto, greedy. A reply's calls are decoded as that handler decodes them (the name and
the arguments' JSON; no calls is a reply that fails to decode) and judged by `ast_checker`
(`irrelevance`: right when no call comes back).

Columns, per server and category: accuracy; `invalid`, calls whose arguments are not a JSON object
valid under the tool's schema, or that name no offered tool; `missing`, cases owed a call that got
none; `unwanted`, calls where none was due (irrelevance); mean latency of a request. The machine's
other load shows in the latency, not in the rest (greedy decoding).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BFCL = ROOT / ".venv" / "bfcl"
sys.path.insert(0, str(ROOT))

from bench.common import table  # noqa: E402

CATEGORIES = ["simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance"]
MAX_TOKENS = 256  # BFCL sends none; a call or a short answer fits, and a model that rambles stops here


def import_bfcl() -> tuple[Any, Any, Any, Any]:
    """BFCL's loaders, checker and types. The checker imports its model table only to ask whether a
    model writes `.` in function names as `_`, and that table imports every vendor's SDK; a table
    that answers yes for any model (as for every OpenAI-API model, whose names cannot hold a `.`)
    stands in for it."""
    if not (BFCL / "bfcl_eval").is_dir():
        sys.exit(f"bfcl-eval is not installed in {BFCL}: make bench (or pip install --no-deps --target {BFCL} "
                 "bfcl-eval==2026.3.23)")
    sys.path.insert(0, str(BFCL))

    class AnyModel(dict):
        def __missing__(self, _name: str) -> Any:
            return types.SimpleNamespace(underscore_to_dot=True)

    table_module = types.ModuleType("bfcl_eval.constants.model_config")
    table_module.MODEL_CONFIG_MAPPING = AnyModel()  # type: ignore[attr-defined]
    sys.modules["bfcl_eval.constants.model_config"] = table_module
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

    return (load_dataset_entry, load_ground_truth_entry, ast_checker,
            types.SimpleNamespace(python=Language.PYTHON, types=GORILLA_TO_OPENAPI))


def to_schema(prop: dict[str, Any], types_map: dict[str, str]) -> dict[str, Any]:
    """A BFCL parameter as JSON Schema, as its OpenAI handler maps them (`dict` is `object`, `float`
    is `number`, ...); what JSON Schema does not know (`optional`) is left out."""
    out = {k: v for k, v in prop.items() if k not in ("type", "properties", "items", "optional")}
    out["type"] = types_map.get(prop.get("type", "string"), "string")
    if prop.get("type") == "float":
        out["description"] = out.get("description", "") + " This is a float type value."
    if "properties" in prop:
        out["properties"] = {k: to_schema(v, types_map) for k, v in prop["properties"].items()}
    if "items" in prop:
        out["items"] = to_schema(prop["items"], types_map)
    return out


def tools_of(functions: list[dict[str, Any]], types_map: dict[str, str]) -> list[dict[str, Any]]:
    tools = []
    for f in functions:
        params = copy.deepcopy(f["parameters"])
        schema = {"type": "object", "properties": {k: to_schema(v, types_map)
                                                    for k, v in params.get("properties", {}).items()}}
        if params.get("required"):
            schema["required"] = params["required"]
        tools.append({"type": "function", "function": {"name": re.sub(r"\.", "_", f["name"]),
                                                       "description": f.get("description", ""),
                                                       "parameters": schema}})
    return tools


@dataclass
class Score:
    cases: int = 0
    right: int = 0
    invalid: int = 0
    missing: int = 0
    unwanted: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, other: Score) -> None:
        self.cases += other.cases
        self.right += other.right
        self.invalid += other.invalid
        self.missing += other.missing
        self.unwanted += other.unwanted
        self.seconds += other.seconds


def invalid_calls(calls: list[tuple[str, str]], tools: list[dict[str, Any]]) -> int:
    from jsonschema import ValidationError, validate

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    bad = 0
    for name, arguments in calls:
        try:
            args = json.loads(arguments)
            if name not in schemas or not isinstance(args, dict):
                raise ValueError(name)
            validate(args, schemas[name])
        except (ValueError, ValidationError):
            bad += 1
    return bad


def run_category(client: Any, model: str, category: str, limit: int | None, bfcl: tuple, verbose: bool) -> Score:
    load_dataset_entry, load_ground_truth_entry, ast_checker, kinds = bfcl
    cases = load_dataset_entry(category)
    answers = {a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)} \
        if category != "irrelevance" else {}
    score = Score()
    for case in cases[:limit]:
        tools = tools_of(case["function"], kinds.types)
        t0 = time.perf_counter()
        reply = client.chat.completions.create(model=model, messages=case["question"][0], tools=tools,
                                               tool_choice="auto", temperature=0, max_tokens=MAX_TOKENS)
        score.seconds.append(time.perf_counter() - t0)
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        score.cases += 1
        score.invalid += invalid_calls(calls, tools)
        decoded = None
        try:  # as BFCL's OpenAI FC handler decodes a reply: no calls is a reply that fails to decode
            if not calls:
                raise ValueError("no calls")
            decoded = [{name: json.loads(arguments)} for name, arguments in calls]
            if not all(isinstance(next(iter(d.values())), dict) for d in decoded):
                raise ValueError("arguments that are not an object")
        except ValueError:
            decoded = None
        if category == "irrelevance":
            right = decoded is None
            score.unwanted += not right
        elif decoded is None:
            right = False
            score.missing += not calls
        else:
            verdict = ast_checker(case["function"], decoded, answers[case["id"]], kinds.python, category, model)
            right = verdict["valid"]
        score.right += right
        if not right:
            said = [f"{n}({a})" for n, a in calls] or [repr((message.content or "")[:120])]
            score.failures.append(f"{case['id']}: {'; '.join(said)}")
        if verbose:
            print(f"  {case['id']}: {'right' if right else 'WRONG'} {calls or repr((message.content or '')[:80])} "
                  f"({score.seconds[-1]:.1f} s)", flush=True)
    return score


def run_server(name: str, client: Any, model: str, categories: list[str], limit: int | None, bfcl: tuple,
               verbose: bool) -> dict[str, Score]:
    scores = {}
    for category in categories:
        t0 = time.perf_counter()
        scores[category] = run_category(client, model, category, limit, bfcl, verbose)
        s = scores[category]
        print(f"{name} {category}: {s.right}/{s.cases} in {time.perf_counter() - t0:.0f} s", flush=True)
    return scores


def wafer_scores(tier: str, grammar: bool, categories: list[str], limit: int | None, bfcl: tuple,
                 verbose: bool) -> dict[str, Score]:
    import openai

    from tests.serving import serve_app
    from wafer.config import EngineSettings
    from wafer.models.loader import load_model
    from wafer.server.app import create_app
    from wafer.server.main import build_served

    served = build_served(load_model(tier, compute="auto"), [tier], EngineSettings(max_model_len=4096))
    served.tool_grammar = grammar
    server = serve_app(create_app(served), served)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
        return run_server(label(tier, grammar), client, tier, categories, limit, bfcl, verbose)
    finally:
        server.stop()


def llama_server_scores(tier: str, categories: list[str], limit: int | None, bfcl: tuple,
                        verbose: bool) -> dict[str, Score] | None:
    import openai

    from bench.build_llama_server import binary
    from tests.serving import free_port, wait_healthy
    from wafer.models import catalog

    if not binary().exists():  # the rest of the table is still worth printing
        print(f"llama-server {tier}: skipped, {binary()} is not built (python bench/build_llama_server.py)")
        return None
    gguf = catalog.installed_path(catalog.find(tier))
    port = free_port()
    # --jinja: the GGUF's own chat template and llama.cpp's tool-call handling for it (Hermes/Qwen
    # for Qwen2.5); two threads, as wafer has; greedy as asked per request.
    argv = [str(binary()), "-m", str(gguf), "--jinja", "--host", "127.0.0.1", "--port", str(port), "-t", "2",
            "-c", "4096", "-np", "1", "--no-webui"]
    log = open(f"/tmp/bfcl-llama-server-{tier}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        return run_server(f"llama-server {tier}", client, tier, categories, limit, bfcl, verbose)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def label(tier: str, grammar: bool) -> str:
    return f"wafer {tier}" + ("" if grammar else " (no grammar)")


def report(results: dict[str, dict[str, Score]], categories: list[str], show_failures: bool) -> None:
    rows = []
    for name, scores in results.items():
        total = Score()
        for category in categories:
            s = scores[category]
            total.add(s)
            rows.append(row(name, category, s))
        rows.append(row(name, "overall", total))
    print(table(["server", "category", "accuracy", "invalid", "missing", "unwanted", "latency"], rows))
    if show_failures:
        for name, scores in results.items():
            for category in categories:
                for f in scores[category].failures:
                    print(f"{name} {category} {f}")


def row(name: str, category: str, s: Score) -> list[str]:
    mean = sum(s.seconds) / len(s.seconds) if s.seconds else 0.0
    return [name, category, f"{s.right}/{s.cases} ({100 * s.right / max(s.cases, 1):.0f}%)", str(s.invalid),
            str(s.missing), str(s.unwanted), f"{mean:.2f} s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="sol,terra,luna", help="wafer's tiers to run ('' for none)")
    ap.add_argument("--llama-server", default="sol,terra", help="tiers whose GGUF llama-server runs ('' for none)")
    ap.add_argument("--grammar", choices=["on", "off", "both"], default="on",
                    help="wafer's tool grammar (off: the calls as the model writes them, parsed)")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--limit", type=int, default=None, help="the first N cases of each category")
    ap.add_argument("--endpoint", help="an OpenAI-compatible base URL to bench instead (with --model)")
    ap.add_argument("--model", help="the model name to ask --endpoint for")
    ap.add_argument("--failures", action="store_true", help="list each case judged wrong, with the reply")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case as it is judged")
    a = ap.parse_args()
    bfcl = import_bfcl()
    categories = [c for c in a.categories.split(",") if c]
    for c in categories:
        if c not in CATEGORIES:
            sys.exit(f"unknown category {c!r}; these run: {', '.join(CATEGORIES)}")
    results: dict[str, dict[str, Score]] = {}
    if a.endpoint:
        import openai

        client = openai.OpenAI(base_url=a.endpoint, api_key=os.environ.get("OPENAI_API_KEY", "x"), max_retries=0,
                               timeout=600)
        results[a.model] = run_server(a.model, client, a.model, categories, a.limit, bfcl, a.verbose)
    else:
        grammars = {"on": [True], "off": [False], "both": [True, False]}[a.grammar]
        for tier in [t for t in a.tiers.split(",") if t]:
            for grammar in grammars:
                results[label(tier, grammar)] = wafer_scores(tier, grammar, categories, a.limit, bfcl, a.verbose)
        for tier in [t for t in a.llama_server.split(",") if t]:
            scores = llama_server_scores(tier, categories, a.limit, bfcl, a.verbose)
            if scores is not None:
                results[f"llama-server {tier}"] = scores
    print(f"\nBFCL v4 (bfcl-eval 2026.3.23), {a.limit or 'all'} cases a category, greedy, tool_choice auto, "
          f"max_tokens {MAX_TOKENS}")
    report(results, categories, a.failures)


if __name__ == "__main__":
    main()
