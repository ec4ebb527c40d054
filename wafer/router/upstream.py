"""Forwarding a request to another OpenAI-compatible server, for tiers served elsewhere."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from wafer import untrusted_json
from wafer.router.config import UpstreamConfig


class UpstreamUnavailable(Exception):
    """The upstream could not answer (down, timed out, 5xx, a body that is not JSON): try the next target."""


@dataclass
class UpstreamReply:
    status: int
    json: dict[str, Any] | None = None  # non-streaming
    stream: AsyncIterator[bytes] | None = None  # streaming: the upstream's SSE events as they come
    retry_after: str | None = None  # a 429's Retry-After, for the client to honour


WAFER_ONLY = frozenset({"prompt_lookup"})


async def forward(client: httpx.AsyncClient, up: UpstreamConfig, path: str, body: dict[str, Any]) -> UpstreamReply:
    """POST body (with the upstream's model name) to up.base_url + path. Raises UpstreamUnavailable
    before any byte has been passed on, so the caller can fall back."""
    headers = {"authorization": f"Bearer {up.api_key}"} if up.api_key else {}
    # wafer's own fields go to wafer servers only: OpenAI refuses a field it does not know.
    payload = {k: v for k, v in body.items() if up.wafer or k not in WAFER_ONLY} | {"model": up.model}
    url = up.base_url + path
    try:
        if not body.get("stream"):
            r = await client.post(url, json=payload, headers=headers, timeout=up.timeout)
            if r.status_code >= 500:
                raise UpstreamUnavailable(f"{up.name}: HTTP {r.status_code}")
            return UpstreamReply(r.status_code, json=_json_object(up, r.status_code, r.content),
                                 retry_after=r.headers.get("retry-after"))
        request = client.build_request("POST", url, json=payload, headers=headers, timeout=up.timeout)
        response = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise UpstreamUnavailable(f"{up.name}: {_why(e)}") from e
    try:
        if response.status_code >= 500:
            raise UpstreamUnavailable(f"{up.name}: HTTP {response.status_code}")
        if response.status_code != 200:
            data = await response.aread()
            await response.aclose()
            return UpstreamReply(response.status_code, json=_json_object(up, response.status_code, data),
                                 retry_after=response.headers.get("retry-after"))
        kind = response.headers.get("content-type", "")
        if not kind.startswith("text/event-stream"):
            raise UpstreamUnavailable(f"{up.name}: HTTP 200 with {kind or 'no content type'}, not an event stream")
    except httpx.HTTPError as e:
        await response.aclose()
        raise UpstreamUnavailable(f"{up.name}: {_why(e)}") from e
    except BaseException:
        await response.aclose()
        raise
    return UpstreamReply(200, stream=_relay(up, response))


def _why(e: httpx.HTTPError) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__  # a timeout's own message is empty


def _json_object(up: UpstreamConfig, status: int, data: bytes) -> dict[str, Any]:
    """The body as a JSON object; one that is not (an HTML error page from a proxy, say) means the
    upstream could not answer in the API's terms."""
    try:
        obj = untrusted_json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise UpstreamUnavailable(f"{up.name}: HTTP {status} with a body that is not a JSON object")
    return obj


async def _relay(up: UpstreamConfig, response: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream's events, each passed on once it is whole. Bytes have reached the client by
    now, so a failure cannot fall back: a half event is dropped and an OpenAI-shaped error event
    ends the stream (a read that waits longer than the upstream's timeout is such a failure)."""
    pending = b""
    try:
        async for data in response.aiter_raw():
            pending += data
            end = max(pending.rfind(b"\n\n"), pending.rfind(b"\r\n\r\n"))
            if end >= 0:
                cut = end + (4 if pending.startswith(b"\r\n\r\n", end) else 2)
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending
    except httpx.HTTPError as e:
        error = {"message": f"The upstream {up.name} failed mid-stream ({_why(e)}).",
                 "type": "server_error", "param": None, "code": "upstream_unavailable"}
        yield f"data: {json.dumps({'error': error})}\n\n".encode()
    finally:
        await response.aclose()
