"""A KV budget smaller than the traffic: through the server and the openai SDK, every request
finishes with the output it has alone, none fails, and /metrics shows the queue and the preemptions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serving import MODEL, start_server
from wafer.engine.kv_layout import BLOCK, bytes_per_token, kv_dtype

QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a river.", "Name a planet.", "Name a tree.", "Name a bird."]


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model_name="{MODEL}"' in line)


@pytest.fixture(scope="module")
def tight(smollm):
    # Ten blocks: two of these requests at a time, at most, hold all their tokens.
    per_block = BLOCK * bytes_per_token(smollm.config, kv_dtype("auto", smollm))
    s = start_server(smollm, max_running=6, engine_kw={"kv_cache_memory": 10 * per_block})
    yield s
    s.stop()


def test_requests_beyond_the_kv_budget_all_finish_as_alone(tight, server):
    from openai import OpenAI

    def ask(base_url: str, question: str) -> str:
        client = OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 48
        return r.choices[0].message.content

    alone = [ask(server.base_url, q) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(tight.base_url, q), QUESTIONS))
    assert together == alone
    tight.wait_idle()
    text = httpx.get(tight.base_url + "/metrics").text
    assert metric(text, "wafer:num_preemptions_total") > 0
    assert metric(text, "wafer:kv_cache_usage_perc") == 0.0
    assert 'wafer:num_requests_waiting{model_name="' + MODEL + '"}' in text
    assert tight.engine.blocks.num_used == 0 and tight.engine.blocks.num_blocks == 10
    # Every block has been written (more tokens than the budget went through), and stays counted.
    assert metric(text, "wafer:kv_cache_written_bytes") == metric(text, "wafer:kv_cache_capacity_bytes") > 0
