"""The OpenAI Agents SDK against each real tier, with one function tool and `tool_choice` auto at
the default temperature: the agent calls the tool and answers from its result. Qwen2.5-Coder-0.5B
writes its call as bare JSON (often in a ```json block), the 1.5B and SmolLM2 (under the generic
prompt) mostly tagged; each must come back as a call, not as text."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving import start_server
from wafer.models import catalog

agents = pytest.importorskip("agents")

TIERS = {"sol": "Qwen2.5-Coder-1.5B-Instruct", "terra": "Qwen2.5-Coder-0.5B-Instruct", "luna": "SmolLM2-135M-Instruct"}
STOCK = 4217  # a number no model would guess
SEED = 1


def installed(tier: str) -> bool:
    model = catalog.find(tier)
    return model is not None and catalog.installed_path(model) is not None


def run_agent(tier: str, max_turns: int) -> tuple[list[str], str | None]:
    """The skus the tool was called with, and the agent's final answer (None if it ran out of turns)."""
    from openai import AsyncOpenAI

    from wafer.models.loader import load_model

    server = start_server(load_model(tier, compute="auto"), names=[TIERS[tier]], max_running=4)
    calls: list[str] = []

    @agents.function_tool
    def get_stock(sku: str) -> str:
        """How many units of a product are in stock."""
        calls.append(sku)
        return f"{STOCK} units of {sku} are in stock."

    try:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        agent = agents.Agent(
            name="stock",
            instructions="You answer questions about stock levels. Use the get_stock tool, then answer "
                         "with the number it gives.",
            model=agents.OpenAIChatCompletionsModel(model=TIERS[tier], openai_client=client),
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
            return calls, None
        return calls, result.final_output
    finally:
        server.stop()


# Issue 19 asks this of every tier; the two small models do not do it yet (the session note says so).
# Not strict: at the default temperature they sometimes do, and an XPASS is worth seeing.
NOT_YET = {
    # It does so in raw completions of the same prompt with no grammar at all (4 samples of 4).
    # Seen after the calls were laid out as the model writes them (issue 52): its first call is right
    # ({"sku": "A7"}); after the result it writes the same call again, four times, as bare JSON.
    "terra": "Qwen2.5-Coder-0.5B calls the tool right, then again after its result instead of answering",
    "luna": "SmolLM2-135M under tool_choice auto often answers in text (code) without calling the tool",
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", [pytest.param(t, marks=pytest.mark.xfail(reason=NOT_YET[t], strict=False))
                                  if t in NOT_YET else t for t in TIERS])
def test_agent_calls_the_tool_and_answers_from_its_result(tier):
    if not installed(tier):
        pytest.skip(f"{TIERS[tier]} is not installed (`wafer models install`)")
    calls, answer = run_agent(tier, max_turns=4)
    assert calls, f"the agent never called the tool; it answered {answer!r}"
    assert all(sku.strip() for sku in calls), calls
    assert answer is not None, f"no answer within 4 turns; the tool was called {len(calls)} times"
    assert str(STOCK) in answer.replace(",", ""), answer
    assert "<tool_call>" not in answer and '"arguments"' not in answer
