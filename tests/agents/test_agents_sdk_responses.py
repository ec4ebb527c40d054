"""The OpenAI Agents SDK with its default model class (the Responses API, no Chat Completions
adapter) runs a multi-turn, tool-using agent against `wafer serve` on sol, end to end."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving import start_server
from wafer.models import catalog

agents = pytest.importorskip("agents")

SOL = "Qwen2.5-Coder-1.5B-Instruct"
STOCK = {"A7": 4217, "B9": 1385}  # numbers no model would guess


@pytest.mark.timeout(600)
def test_agents_sdk_default_model_runs_a_multi_turn_tool_agent(tmp_path):
    model = catalog.find("sol")
    if model is None or catalog.installed_path(model) is None:
        pytest.skip(f"{SOL} is not installed (`wafer models install`)")
    from openai import AsyncOpenAI

    from wafer.models.loader import load_model

    server = start_server(load_model("sol", compute="auto"), names=[SOL], max_running=4, state_db=tmp_path / "s.db")
    calls: list[str] = []

    @agents.function_tool
    def get_stock(sku: str) -> str:
        """How many units of a product are in stock."""
        calls.append(sku)
        return f"{STOCK.get(sku.strip().upper(), 0)} units of {sku} are in stock."

    try:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_tracing_disabled(True)
        agent = agents.Agent(
            name="stock", model=SOL, tools=[get_stock],
            instructions="You answer questions about stock levels. Use the get_stock tool, then answer with the "
                         "number it gives.",
            # "required" for each run's first turn (the SDK resets it to auto after a call): under auto, sol
            # answers the follow-up with a number in the form of its first answer, without calling the tool.
            model_settings=agents.ModelSettings(max_tokens=80, tool_choice="required", extra_body={"seed": 1}),
        )
        async def conversation():  # type: ignore[no-untyped-def]
            first = await agents.Runner.run(agent, "How many units of product A7 are in stock?", max_turns=4)
            follow = first.to_input_list() + [{"role": "user", "content": "And how many units of product B9 are in stock?"}]
            return first, await agents.Runner.run(agent, follow, max_turns=4)

        one, two = asyncio.run(conversation())
        first, second = one.final_output, two.final_output
        # the SDK's default model class went through /v1/responses (ids of stored responses)
        assert all(r.response_id and r.response_id.startswith("resp_") for r in one.raw_responses + two.raw_responses)
    finally:
        server.stop()
    assert [c.strip().upper() for c in calls][:1] == ["A7"] and "B9" in [c.strip().upper() for c in calls], \
        (calls, first, second)
    assert "4217" in first.replace(",", ""), first
    assert "1385" in second.replace(",", ""), second
