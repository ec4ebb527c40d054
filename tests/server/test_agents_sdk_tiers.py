"""The OpenAI Agents SDK against each real tier, with one function tool and `tool_choice` auto at
the default temperature: the agent calls the tool and answers from its result. Qwen2.5-Coder-0.5B
writes its call as bare JSON (often in a ```json block), the 1.5B and SmolLM2 (under the generic
prompt) mostly tagged; each must come back as a call, not as text. terra is asked for by its tier
name, behind the router: its model calls the tool again after the result instead of answering, so
that turn goes to sol ([routing] no_tool_results), and the test checks who served each turn."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.serving import RunningServer, serve_app, start_server
from wafer.config import NO_TOOL_RESULTS, ROUTING_TIERS, EngineSettings
from wafer.models import catalog
from wafer.router.config import LocalModelConfig, RoutingConfig, ServeConfig
from wafer.router.router import Router
from wafer.server.app import create_app, prompt_counter
from wafer.server.main import build_served

agents = pytest.importorskip("agents")

TIERS = {"sol": "Qwen2.5-Coder-1.5B-Instruct", "terra": "Qwen2.5-Coder-0.5B-Instruct", "luna": "SmolLM2-135M-Instruct"}
STOCK = 4217  # a number no model would guess
SEED = 1


def installed(tier: str) -> bool:
    model = catalog.find(tier)
    return model is not None and catalog.installed_path(model) is not None


def serve(tier: str) -> tuple[RunningServer, str]:
    """A server for the tier, and the model name to ask for: the model's own, or for a tier of
    [routing] no_tool_results, the tier's name behind the router, with the tier its results go to."""
    from wafer.models.loader import load_model

    if tier not in NO_TOOL_RESULTS:
        return start_server(load_model(tier, compute="auto"), names=[TIERS[tier]], max_running=4), TIERS[tier]
    on = ROUTING_TIERS["tool_results"]
    settings = EngineSettings(max_running=4, max_waiting=16, max_model_len=2048)
    served = [build_served(load_model(t, compute="auto"), [TIERS[t]], settings) for t in (tier, on)]
    cfg = ServeConfig(models={TIERS[t]: LocalModelConfig(TIERS[t], t) for t in (tier, on)}, upstreams={},
                      tiers={t: [TIERS[on] if t == on else TIERS[tier]] for t in TIERS}, aliases={},
                      routing=RoutingConfig())
    cfg.check()
    app = create_app(served, router=Router(cfg, prompt_counter(served[0])), upstreams={})
    return serve_app(app, *served), tier


def run_agent(tier: str, max_turns: int) -> tuple[list[str], str | None, list[tuple[str, str, bool]]]:
    """The skus the tool was called with, the agent's final answer (None if it ran out of turns), and
    for each model turn: the tier and rule that served it (x-wafer-tier, x-wafer-route) and whether
    its request ended with a tool result."""
    import httpx
    from openai import AsyncOpenAI

    server, model = serve(tier)
    calls: list[str] = []
    turns: list[tuple[str, str, bool]] = []

    async def record(response: httpx.Response) -> None:
        body = json.loads(response.request.content)
        turns.append((response.headers.get("x-wafer-tier", ""), response.headers.get("x-wafer-route", ""),
                      body["messages"][-1]["role"] == "tool"))

    @agents.function_tool
    def get_stock(sku: str) -> str:
        """How many units of a product are in stock."""
        calls.append(sku)
        return f"{STOCK} units of {sku} are in stock."

    try:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300,
                             http_client=httpx.AsyncClient(timeout=300, event_hooks={"response": [record]}))
        agent = agents.Agent(
            name="stock",
            instructions="You answer questions about stock levels. Use the get_stock tool, then answer "
                         "with the number it gives.",
            model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
            tools=[get_stock],
            # Sampled at the model's default temperature, from a fixed seed: a run that fails can be run
            # again and looked at, rather than come and go.
            model_settings=agents.ModelSettings(tool_choice="auto", max_tokens=80, extra_args={"seed": SEED}),
        )
        agents.set_tracing_disabled(True)
        try:
            result = asyncio.run(agents.Runner.run(agent, "How many units of product A7 are in stock?",
                                                   max_turns=max_turns))
        except agents.exceptions.MaxTurnsExceeded:
            return calls, None, turns
        return calls, result.final_output, turns
    finally:
        server.stop()


# Issue 19 asks this of every tier; luna does not do it yet (the session note says so).
# Not strict: at the default temperature it sometimes does, and an XPASS is worth seeing.
NOT_YET = {
    "luna": "SmolLM2-135M under tool_choice auto often answers in text (code) without calling the tool",
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", [pytest.param(t, marks=pytest.mark.xfail(reason=NOT_YET[t], strict=False))
                                  if t in NOT_YET else t for t in TIERS])
def test_agent_calls_the_tool_and_answers_from_its_result(tier):
    routed_to = ROUTING_TIERS["tool_results"] if tier in NO_TOOL_RESULTS else None
    if not installed(tier) or (routed_to and not installed(routed_to)):
        pytest.skip(f"{TIERS[tier]} (or the tier its tool results go to) is not installed (`wafer models install`)")
    calls, answer, turns = run_agent(tier, max_turns=4)
    assert calls, f"the agent never called the tool; it answered {answer!r}"
    assert all(sku.strip() for sku in calls), calls
    assert answer is not None, f"no answer within 4 turns; the tool was called {len(calls)} times"
    assert str(STOCK) in answer.replace(",", ""), answer
    assert "<tool_call>" not in answer and '"arguments"' not in answer
    if routed_to:
        # The tier's own model made the call; the turn after its result reached the tier that answers.
        assert turns[0] == (tier, "tier", False), turns
        assert all((t, r) == (routed_to, "tool_results") for t, r, after_result in turns if after_result), turns
        assert any(after_result for _, _, after_result in turns), turns
