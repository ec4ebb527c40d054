"""Many clients at once: each gets what it gets alone, and the engine really batched them."""

from __future__ import annotations

import asyncio

from tests.serving import MODEL

TOPICS = ["cats", "the moon", "bread", "rivers", "chess", "winter", "robots", "tea", "music", "trains", "bees",
          "volcanoes", "libraries", "the ocean", "bicycles", "clocks"]


def test_sixteen_streaming_clients_match_solo_runs(server):
    """The sixteen run together first, on prompts the server has not seen, so that their prefills are
    batched and computed (not found in the prefix cache, which the solo runs after them then hit)."""
    from openai import AsyncOpenAI

    prompts = [[{"role": "user", "content": f"Write one short sentence about {t}, please."}] for t in TOPICS]
    running_seen: list[int] = []

    async def main():
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)

        async def one(messages) -> tuple[str, int]:
            stream = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                          max_tokens=24, stream=True,
                                                          stream_options={"include_usage": True})
            text, computed = [], -1
            async for c in stream:
                if c.choices:
                    text.append(c.choices[0].delta.content or "")
                if c.usage:
                    computed = c.usage.prompt_tokens - c.usage.prompt_tokens_details.cached_tokens
            return "".join(text), computed

        before = server.engine.stats.batched_steps
        done = asyncio.Event()

        async def watch():
            while not done.is_set():
                running_seen.append(server.engine.num_running)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        together = await asyncio.gather(*(one(m) for m in prompts))
        done.set()
        await watcher
        batched = server.engine.stats.batched_steps - before
        alone = [await one(m) for m in prompts]
        await client.close()
        return together, alone, batched

    together, alone, batched = asyncio.run(main())
    # The user's message (10+ tokens) was prefilled in the batch, only the shared system prompt cached.
    assert all(computed >= 10 for _, computed in together), together
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert batched >= 20  # steps that advanced several sequences at once
    assert max(running_seen) >= 8
