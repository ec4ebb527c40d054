"""Request validation (wafer/server/protocol.py) without a server: values the engine cannot take are
refused here, naming their parameter."""

from __future__ import annotations

import pytest

from wafer.server.errors import APIError
from wafer.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body


def chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("seed", [2**63, 2**64, 10**30, -(2**63) - 1])
@pytest.mark.parametrize("model, body", [(ChatCompletionRequest, chat()), (CompletionRequest, {"model": "m",
                                                                                               "prompt": "hi"})])
def test_a_seed_beyond_64_bits_is_a_400_naming_seed(model, body, seed):
    # torch.Generator().manual_seed overflows past 64 bits; the fuzzer's 2**64 got 400 "Overflow when
    # unpacking long long" with no param, from inside the engine.
    with pytest.raises(APIError) as e:
        parse_body(model, {**body, "seed": seed})
    assert (e.value.status, e.value.param) == (400, "seed")


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -(2**63)])
def test_every_64_bit_seed_is_accepted(seed):
    assert parse_body(ChatCompletionRequest, chat(seed=seed)).seed == seed
