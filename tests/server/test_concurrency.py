"""Many clients at once: each gets what it gets alone, and the engine really batched them."""

from __future__ import annotations

import asyncio

from tests.serving import MODEL

TOPICS = ["cats", "the moon", "bread", "rivers", "chess", "winter", "robots", "tea", "music", "trains", "bees",
          "volcanoes", "libraries", "the ocean", "bicycles", "clocks"]


def test_sixteen_streaming_clients_match_solo_runs(server):
    from openai import AsyncOpenAI

    prompts = [[{"role": "user", "content": f"Write one sentence about {t}."}] for t in TOPICS]
    running_seen: list[int] = []

    async def main():
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)

        async def one(messages):
            stream = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                          max_tokens=24, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        alone = [await one(m) for m in prompts]
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
        await client.close()
        return alone, together, server.engine.stats.batched_steps - before

    alone, together, batched = asyncio.run(main())
    assert together == alone
    assert batched >= 20  # steps that advanced several sequences at once
    assert max(running_seen) >= 8
