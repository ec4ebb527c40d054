"""Direct tool calling against programmatic tool calling (PTC), side by side, on the same backend.

Each task runs as an agent loop through `/v1/responses` and the `openai` SDK, the client running
the tools: once with the tools offered directly, once with them behind `programmatic_tool_calling`.
Per task and mode it prints the tokens the model read and wrote, the model turns, the wall time and
whether the answer matched.

- Ultra: N parts at once against the same parts one after another; Max: tokens and time per effort.
- The scripted rows: a policy that makes the best calls in each mode, on a backend that counts
  tokens as a real model would (the chat template of --count-model with the tools, through its
  tokenizer). These measure what PTC saves when the model does its part well.
- With --real TIER: the same tasks on a real model served by wafer (the in-process chat path).

    .venv/bin/python bench/agents.py [--real sol]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai  # noqa: E402

from tests.serving import serve_app, start_server  # noqa: E402
from wafer.agents import ultra  # noqa: E402
from wafer.agents.responses import ResponsesService  # noqa: E402
from wafer.agents.store import ResponseStore  # noqa: E402
from wafer.config import EngineSettings  # noqa: E402
from wafer.models.catalog import find  # noqa: E402
from wafer.models.chat_template import ChatTemplate  # noqa: E402
from wafer.models.loader import load_model, load_tokenizer  # noqa: E402
from wafer.server.app import create_app  # noqa: E402
from wafer.server.main import build_served  # noqa: E402

# --- the world the tools read --------------------------------------------------------------------
# Records as an inventory or order service returns them: the fields a client may want, not only the
# one a task needs.
STOCK = {f"P{i:02d}": {"sku": f"P{i:02d}", "name": f"Product {i}", "category": ["tools", "garden", "kitchen"][i % 3],
                       "units": (i * 37) % 91 + 4, "warehouse": ["north", "south", "east"][i % 3],
                       "reorder_level": 20, "supplier": f"S{i % 4}", "price": round(4.5 + i * 1.25, 2),
                       "updated": f"2026-11-{i + 1:02d}T08:00:00Z"} for i in range(1, 13)}
ORDERS = [{"id": f"O{k:03d}", "customer": f"C{k % 9}", "amount": round(17.5 * ((k * 7) % 23) + 3, 2),
           "status": ["shipped", "pending", "cancelled"][(k // 9) % 3], "items": (k % 4) + 1,
           "created": f"2026-10-{k % 28 + 1:02d}"} for k in range(200)]
RATES = {"EUR": 1.08, "GBP": 1.27}


class World:
    """The tools as the client runs them; the rate service fails twice before it answers."""

    def __init__(self) -> None:
        self.rate_failures = 2
        self.calls = 0

    def run(self, name: str, args: dict[str, Any]) -> str:
        self.calls += 1
        if name == "get_stock":
            return json.dumps(STOCK.get(args.get("sku", ""), {"error": "unknown sku"}))
        if name == "list_orders":
            return json.dumps([o for o in ORDERS if o["customer"] == args.get("customer")])
        if name == "get_rate":
            if self.rate_failures > 0:
                self.rate_failures -= 1
                return json.dumps({"error": "rate service temporarily unavailable; retry"})
            return json.dumps({"currency": args.get("currency"), "usd": RATES.get(args.get("currency", ""), 0)})
        return json.dumps({"error": f"no tool {name}"})


def _fn(name: str, description: str, props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props),
                           "additionalProperties": False}}


TOOLS = {
    "get_stock": _fn("get_stock", "Stock record of one product: units, warehouse, reorder level.",
                     {"sku": {"type": "string"}}),
    "list_orders": _fn("list_orders", "Every order of a customer, with amount and status.",
                       {"customer": {"type": "string"}}),
    "get_rate": _fn("get_rate", "USD value of one unit of a currency. May fail; then retry.",
                    {"currency": {"type": "string"}}),
}


@dataclass
class Task:
    name: str
    question: str
    tools: list[str]
    expected: str
    direct: Callable[[list[dict[str, Any]]], Any]  # the scripted policy's turn, from the messages so far
    program: str  # the scripted policy's program in PTC mode


def _tool_results(messages: list[dict[str, Any]]) -> list[Any]:
    return [json.loads(m["content"]) for m in messages if m["role"] == "tool"]


def _program_output(messages: list[dict[str, Any]]) -> str:
    return messages[-1]["content"].strip()


SKUS = [f"P{i:02d}" for i in range(1, 9)]
TOTAL = sum(STOCK[s]["units"] for s in SKUS)
C7 = sum(o["amount"] for o in ORDERS if o["customer"] == "C7" and o["status"] == "shipped" and o["amount"] > 100)


def _lookup_direct(messages: list[dict[str, Any]]) -> Any:
    results = _tool_results(messages)
    if not results:
        return [("get_stock", {"sku": s}) for s in SKUS]
    return f"In all, {sum(r['units'] for r in results)} units are in stock."


def _filter_direct(messages: list[dict[str, Any]]) -> Any:
    results = _tool_results(messages)
    if not results:
        return [("list_orders", {"customer": "C7"})]
    total = sum(o["amount"] for o in results[0] if o["status"] == "shipped" and o["amount"] > 100)
    return f"The total is {total:.2f}."


def _retry_direct(messages: list[dict[str, Any]]) -> Any:
    results = _tool_results(messages)
    if not results or "error" in results[-1]:
        return [("get_rate", {"currency": "EUR"})]
    return f"250 EUR is {250 * results[-1]['usd']:.2f} USD."


TASKS = [
    Task("lookups over a list", f"How many units of products {', '.join(SKUS)} are in stock in all? Use the "
         "tools, then answer with the total.", ["get_stock"], str(TOTAL), _lookup_direct,
         "total = 0\nfor sku in " + json.dumps(SKUS) + ":\n    r = await get_stock(sku=sku)\n"
         "    total += r['units']\ntext(total)"),
    Task("filter and aggregate", "What is the total amount of customer C7's shipped orders over 100? Use the "
         "tools.", ["list_orders"], f"{C7:.2f}", _filter_direct,
         "orders = await list_orders(customer='C7')\n"
         "text(f\"{sum(o['amount'] for o in orders if o['status'] == 'shipped' and o['amount'] > 100):.2f}\")"),
    Task("retry on an error", "What is 250 EUR in USD? Use the get_rate tool; it may fail, then retry.",
         ["get_rate"], f"{250 * RATES['EUR']:.2f}", _retry_direct,
         "for attempt in range(5):\n    r = await get_rate(currency='EUR')\n    if 'usd' in r:\n"
         "        break\ntext(f\"{250 * r['usd']:.2f}\")"),
]


def _ptc_policy(task: Task) -> Callable[[list[dict[str, Any]]], Any]:
    def turn(messages: list[dict[str, Any]]) -> Any:
        if messages[-1]["role"] != "tool":
            return [("run_program", {"code": task.program})]
        out = _program_output(messages)
        return f"The answer is {out}."
    return turn


# --- a scripted backend that counts tokens as a real model reads them ------------------------------
class CountingScript:
    """Plays a policy; counts each turn's prompt as the chat template of a real model renders it with
    its tools, and its reply as the text that model would write (calls in <tool_call> tags)."""

    def __init__(self, count_model: str) -> None:
        from wafer.server.chat import ChatHandler

        self.tok = load_tokenizer(count_model)
        template = ChatTemplate(self.tok.chat_template, self.tok.bos_token, self.tok.eos_token)
        self.handler = ChatHandler(SimpleNamespace(chat_template=template))  # type: ignore[arg-type]
        self.policy: Callable[[list[dict[str, Any]]], Any] = lambda m: "?"
        self.turns = 0

    async def stream(self, body: dict[str, Any]):  # type: ignore[no-untyped-def]
        self.turns += 1
        messages = body["messages"]
        tools = body.get("tools") or []
        prompt = self.handler._render(messages, tools, body.get("tool_choice", "auto") if tools else "none")
        turn = self.policy(messages)
        head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body["model"]}
        if isinstance(turn, str):
            written = turn
            yield {**head, "choices": [{"index": 0, "delta": {"content": turn}, "finish_reason": "stop"}]}
        else:
            written = "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in turn)
            yield {**head, "choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {"tool_calls": [
                {"index": k, "id": f"call_b{self.turns}_{k}", "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a)}} for k, (n, a) in enumerate(turn)]}}]}
        read, wrote = len(self.tok.encode(prompt, add_special_tokens=False)), len(self.tok.encode(written))
        yield {**head, "choices": [], "usage": {"prompt_tokens": read, "completion_tokens": wrote,
                                                "total_tokens": read + wrote}}


# --- the agent loop, as a client runs it -------------------------------------------------------------
INSTRUCTIONS = ("You are an agent with tools. Call the tools to get the data you need; do not explain how to "
                "write code. When you have the result, answer in one short sentence.")


def tools_for(task: Task, mode: str) -> list[dict[str, Any]]:
    if mode == "direct":
        return [TOOLS[t] for t in task.tools]
    return [{"type": "programmatic_tool_calling"}, *({**TOOLS[t], "allowed_callers": ["programmatic"]}
                                                     for t in task.tools)]


def run_task(client: openai.OpenAI, model: str, task: Task, mode: str, max_rounds: int = 12,
             **settings: Any) -> dict[str, Any]:
    world = World()
    tools = tools_for(task, mode)
    start = time.perf_counter()
    read = wrote = turns = 0
    r = client.responses.create(model=model, input=task.question, tools=tools, **settings)
    for _ in range(max_rounds):
        read += r.usage.input_tokens
        wrote += r.usage.output_tokens
        turns += len((r.model_extra or {}).get("accounting", {}).get("turns", []))
        calls = [i for i in r.output if i.type == "function_call"]
        if not calls:
            break
        outputs = [{"type": "function_call_output", "call_id": c.call_id,
                    "output": world.run(c.name, json.loads(c.arguments or "{}"))} for c in calls]
        r = client.responses.create(model=model, previous_response_id=r.id, input=outputs, tools=tools, **settings)
    answer = r.output_text or ""
    ok = task.expected in answer.replace(",", "")
    programs = [i for i in r.output if i.type == "program_output"]
    return {"read": read, "wrote": wrote, "turns": turns, "seconds": time.perf_counter() - start, "ok": ok,
            "tool_calls": world.calls, "answer": answer.strip().replace("\n", " ")[:90],
            "program": programs[-1].status if programs else "-"}


def table(title: str, rows: list[tuple[str, str, dict[str, Any]]]) -> None:
    print(f"\n{title}")
    print("| task | mode | tokens read | tokens written | model turns | tool calls | wall s | correct | answer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task, mode, m in rows:
        print(f"| {task} | {mode} | {m['read']} | {m['wrote']} | {m['turns']} | {m['tool_calls']} | "
              f"{m['seconds']:.2f} | {'yes' if m['ok'] else 'no'} | {m['answer']} |")
    for mode in ("direct", "ptc"):
        tot = [m for _, md, m in rows if md == mode]
        print(f"{mode}: {sum(m['read'] for m in tot)} tokens read, {sum(m['wrote'] for m in tot)} written, "
              f"{sum(m['turns'] for m in tot)} model turns, {sum(m['ok'] for m in tot)}/{len(tot)} correct")
    dr = sum(m["read"] for _, md, m in rows if md == "direct")
    pr = sum(m["read"] for _, md, m in rows if md == "ptc")
    if dr:
        print(f"PTC / direct, tokens read: {pr / dr:.2f} ({(1 - pr / dr) * 100:.0f}% fewer)")
    d = sum(m["read"] + m["wrote"] for _, md, m in rows if md == "direct")
    p = sum(m["read"] + m["wrote"] for _, md, m in rows if md == "ptc")
    if d:
        print(f"PTC / direct, tokens read and written: {p / d:.2f} ({(1 - p / d) * 100:.0f}% fewer)")


AGENT_TOKENS = 256
ANIMALS = ["owls", "bees", "foxes", "whales", "crows", "otters", "ants", "bats", "wolves", "frogs", "moths", "seals",
           "hares", "newts", "larks", "crabs"]


def _ultra_once(client: openai.OpenAI, model: str, n: int, task: str, forget: Callable[[], None]) -> dict[str, Any]:
    forget()
    t0 = time.perf_counter()
    r = client.responses.create(model=model, input=task, temperature=0, max_output_tokens=200,
                                extra_body={"multi_agent": {"enabled": True, "max_concurrent_subagents": n,
                                                           "max_output_tokens_per_agent": AGENT_TOKENS}})
    wall = time.perf_counter() - t0
    acct = r.model_extra["accounting"]
    root_turns = [t for t in acct["turns"] if t.get("agent") == "root"]
    agents = {name: a for name, a in acct["agents"].items() if name != "root"}
    return {"wall": wall, "plan": root_turns[0]["seconds"], "synthesis": root_turns[-1]["seconds"],
            "agents": max(a["seconds"] for a in agents.values()),
            "parts": {name: a["part"] for name, a in acct["ultra"]["agents"].items()},
            "results": {name: (a["part"], a.get("result", "")) for name, a in acct["ultra"]["agents"].items()},
            "written": [a["output_tokens"] for a in agents.values()]}


def _synthesis_once(client: openai.OpenAI, model: str, task: str, results: dict[str, tuple[str, str]],
                    lookup: bool, forget: Callable[[], None]) -> tuple[float, str]:
    """Ultra's synthesis turn as it sends it (its instructions, the task, the agents' results), as one
    chat completion, with or without prompt lookup; its prompt computed afresh, as in Ultra."""
    forget()
    note = "Results of the agents:\n\n" + "\n\n".join(f"{name} ({part}):\n{result}"
                                                        for name, (part, result) in results.items())
    messages = [{"role": "system", "content": ultra.SYNTHESIS}, {"role": "user", "content": task},
                {"role": "user", "content": note}]
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=200,
                                       extra_body={"prompt_lookup": lookup})
    return time.perf_counter() - t0, r.choices[0].message.content or ""


def _sequential_once(client: openai.OpenAI, model: str, n: int, task: str, parts: dict[str, str],
                     forget: Callable[[], None]) -> tuple[float, int]:
    """Ultra's parts one after another, each as its sub-agent runs it (its instructions, its budget)."""
    forget()
    written = 0
    t0 = time.perf_counter()
    for name, part in parts.items():
        one = client.responses.create(
            model=model, input=ultra.PART.format(name=name, part=part), temperature=0,
            max_output_tokens=AGENT_TOKENS, instructions=ultra.SUBAGENT.format(n=n, task=task))
        written += one.usage.output_tokens
    return time.perf_counter() - t0, written


def ultra_rows(client: openai.OpenAI, model: str, ns: list[int], forget: Callable[[], None], rounds: int) -> None:
    """Ultra against the same parts run one after another, on the same engine, greedy so that both
    write the same; `rounds` alternating runs of each, medians. `forget` empties the prefix cache
    (the server idle): each run starts without the other's prompts.

    Two speed-ups. The parts: the N sub-tasks as Ultra's agents ran them against the same N one
    after another (what the issue compares: a fan-out of N should cost little more than one agent).
    The whole: Ultra's wall time, its plan and synthesis included, against the parts one after
    another; and like for like, against the parts one after another with Ultra's plan and synthesis
    added (the same pipeline at a concurrency of one)."""
    print(f"\nUltra on {model}: N parts at once against the same N parts one after another, greedy; "
          f"each part up to {AGENT_TOKENS} tokens; medians of {rounds} alternating rounds")
    print("| N | Ultra wall s | of which plan s | agents s | synthesis s | sequential wall s (the N parts) | "
          "speed-up, the parts (agents s vs sequential) | speed-up, whole (Ultra wall vs sequential) | "
          "sequential + Ultra's plan and synthesis s | speed-up on that | Ultra tokens written | "
          "sequential tokens written | longest part's tokens | the parts' ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # A first Ultra run pays for what any server pays once (the prefill budget's first measures, the
    # plan grammar's first compile); the rows below are the steady state.
    client.responses.create(model=model, input="Write a short paragraph about each of these birds: robins, gulls.",
                            temperature=0, max_output_tokens=32,
                            extra_body={"multi_agent": {"enabled": True, "max_concurrent_subagents": 2,
                                                        "max_output_tokens_per_agent": 32}})
    med = statistics.median
    synthesis: list[tuple[int, str, dict[str, tuple[str, str]]]] = []
    for n in ns:
        task = "Write a short paragraph about each of these animals: " + ", ".join(ANIMALS[:n]) + "."
        runs, seqs, seq_written = [], [], set()
        for _ in range(rounds):
            runs.append(_ultra_once(client, model, n, task, forget))
            seconds, written = _sequential_once(client, model, n, task, runs[-1]["parts"], forget)
            seqs.append(seconds)
            seq_written.add(written)
        wall, plan_s, agents_s, synth_s = (med(r[k] for r in runs) for k in ("wall", "plan", "agents", "synthesis"))
        seq = med(seqs)
        written = runs[-1]["written"]
        same = len({sum(r["written"]) for r in runs} | seq_written) == 1
        # Together the parts take at least as many steps as the longest of them writes tokens: their
        # speed-up is at most all their tokens over those, however little a step's rows cost.
        print(f"| {n} | {wall:.2f} | {plan_s:.2f} | {agents_s:.2f} | {synth_s:.2f} | {seq:.2f} | "
              f"{seq / agents_s:.2f}x | {seq / wall:.2f}x | {plan_s + seq + synth_s:.2f} | "
              f"{(plan_s + seq + synth_s) / wall:.2f}x | {sum(written)} | "
              f"{'/'.join(str(w) for w in sorted(seq_written))}{'' if same else ' (differ)'} | {max(written)} | "
              f"{sum(written) / max(written):.2f}x |")
        synthesis.append((n, task, runs[-1]["results"]))
    # The synthesis drafted by prompt lookup (as Ultra sends it) against the same turn without.
    print(f"\nUltra's synthesis turn alone, rebuilt from the last run's results: with prompt lookup (as Ultra "
          f"asks) against without, greedy; medians of {rounds} alternating rounds")
    print("| N | without s | with prompt_lookup s | speed-up | same text |")
    print("|---|---|---|---|---|")
    for n, task, results in synthesis:
        plain, looked, texts = [], [], set()
        for _ in range(rounds):
            for lookup, times in ((False, plain), (True, looked)):
                seconds, text = _synthesis_once(client, model, task, results, lookup, forget)
                times.append(seconds)
                texts.add(text)
        print(f"| {n} | {med(plain):.2f} | {med(looked):.2f} | {med(plain) / med(looked):.2f}x | "
              f"{'yes' if len(texts) == 1 else 'NO'} |")


def max_rows(client: openai.OpenAI, model: str, efforts: list[str]) -> None:
    """Max: the same question at each reasoning effort, greedy."""
    question = ("A farmer has 17 sheep. All but 9 run away. He then buys twice as many as he has left. "
                "How many sheep does he have now?")
    print(f"\nMax on {model}: one question at each reasoning.effort, greedy (answer: 27)")
    print("| effort | reasoning tokens | answer tokens | output tokens | wall s | answer |")
    print("|---|---|---|---|---|---|")
    for effort in efforts:
        t0 = time.perf_counter()
        r = client.responses.create(model=model, input=question, temperature=0, max_output_tokens=1200,
                                    reasoning={"effort": effort})
        wall = time.perf_counter() - t0
        thought = r.usage.output_tokens_details.reasoning_tokens
        answer = " ".join(r.output_text.split())[:70]
        print(f"| {effort} | {thought} | {r.usage.output_tokens - thought} | {r.usage.output_tokens} | {wall:.2f} | "
              f"{answer} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count-model", default="sol", help="whose chat template and tokenizer count the scripted "
                    "turns' tokens (default sol: Qwen2.5-Coder-1.5B-Instruct)")
    ap.add_argument("--real", action="append", default=[], help="also run on this tier or model (repeatable)")
    ap.add_argument("--ultra", default="4,8,16", help="Ultra's N to measure on the default model ('' for none)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating Ultra and sequential runs per N (medians)")
    ap.add_argument("--max", default="none,minimal,low,medium", help="Max's efforts to measure on the default model")
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp()) / "state.db"

    script = CountingScript(args.count_model)
    small = load_model("luna", compute="auto")  # the app needs a model; the scripted backend answers
    server = start_server(small, names=["scripted"], responses=ResponsesService(script, ResponseStore(state)))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
    rows = []
    for task in TASKS:
        for mode in ("direct", "ptc"):
            script.policy = task.direct if mode == "direct" else _ptc_policy(task)
            rows.append((task.name, mode, run_task(client, "scripted", task, mode)))
    server.stop()
    if args.ultra or args.max:
        served = build_served(small, ["SmolLM2-135M-Instruct"])
        server = serve_app(create_app(served, state_db=state), served)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=900)
        if args.ultra:
            ultra_rows(client, "SmolLM2-135M-Instruct", [int(n) for n in args.ultra.split(",")],
                       served.engine.engine.blocks.forget_prefixes, args.rounds)
        if args.max:
            max_rows(client, "SmolLM2-135M-Instruct", args.max.split(","))
        server.stop()
    table(f"scripted policy (tokens counted with {find(args.count_model).name if find(args.count_model) else args.count_model}'s "
          "template and tokenizer)", rows)

    for tier in args.real:
        loaded = load_model(tier, compute="auto")
        served = build_served(loaded, [loaded.name], EngineSettings(max_running=4, max_model_len=8192))
        server = serve_app(create_app(served, state_db=state), served)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
        rows = []
        for task in TASKS:
            for mode in ("direct", "ptc"):
                try:
                    m = run_task(client, loaded.name, task, mode, temperature=0, max_output_tokens=400,
                                 instructions=INSTRUCTIONS)
                except openai.APIError as e:
                    why = " ".join(str(e).split())[:80]
                    m = {"read": 0, "wrote": 0, "turns": 0, "seconds": 0.0, "ok": False, "tool_calls": 0,
                         "answer": f"error: {why}", "program": "-"}
                rows.append((task.name, mode, m))
        server.stop()
        table(f"real model: {loaded.name} (tier {tier}), greedy, instructions: {INSTRUCTIONS!r}", rows)


if __name__ == "__main__":
    main()
