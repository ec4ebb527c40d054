"""Forwarding a request to another OpenAI-compatible server, for tiers served elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from wafer.router.config import UpstreamConfig


class UpstreamUnavailable(Exception):
    """The upstream could not answer (down, timed out, 5xx): try the next target."""


@dataclass
class UpstreamReply:
    status: int
    json: dict[str, Any] | None = None  # non-streaming
    stream: AsyncIterator[bytes] | None = None  # streaming: the upstream's SSE bytes as they come


async def forward(client: httpx.AsyncClient, up: UpstreamConfig, path: str, body: dict[str, Any]) -> UpstreamReply:
    """POST body (with the upstream's model name) to up.base_url + path. Raises UpstreamUnavailable
    before any byte has been passed on, so the caller can fall back."""
    headers = {"authorization": f"Bearer {up.api_key}"} if up.api_key else {}
    payload = {**body, "model": up.model}
    url = up.base_url + path
    try:
        if not body.get("stream"):
            r = await client.post(url, json=payload, headers=headers, timeout=up.timeout)
            if r.status_code >= 500:
                raise UpstreamUnavailable(f"{up.name}: HTTP {r.status_code}")
            return UpstreamReply(r.status_code, json=r.json())
        request = client.build_request("POST", url, json=payload, headers=headers, timeout=up.timeout)
        response = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise UpstreamUnavailable(f"{up.name}: {type(e).__name__}: {e}") from e
    if response.status_code >= 500:
        await response.aclose()
        raise UpstreamUnavailable(f"{up.name}: HTTP {response.status_code}")
    if response.status_code != 200:
        data = (await response.aread())
        await response.aclose()
        import json

        return UpstreamReply(response.status_code, json=json.loads(data))

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    return UpstreamReply(200, stream=relay())
