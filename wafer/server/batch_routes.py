"""The Batch API's routes: /v1/files (input files of purpose `batch`, and the output and error
files batches write) and /v1/batches. Each reads the tenant of the request's key from
`request.state.tenant` (None without keys): files and batches belong to it, and another tenant's
ids are not found."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from wafer.errors import APIError, bad_request
from wafer.server.batches import Batches, new_id

PURPOSES = ("batch",)  # what an upload may be for; batches write theirs as `batch_output`


def tenant(request: Request) -> str | None:
    return getattr(request.state, "tenant", None)


def _file_not_found(fid: str) -> APIError:
    return APIError(404, f"No such File object: {fid}", "invalid_request_error", "file_id", "not_found")


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"limit must be an integer from 1 to {most}.", "limit", "invalid_value")
    return int(raw)


def add_batch_routes(v1: APIRouter, batches: Batches, max_file_bytes: int,
                     read_json: Callable[[Request], Awaitable[Any]]) -> None:
    """The routes on `v1` (which holds the server's authentication); `read_json`: the app's reading
    of a JSON body, with its errors."""

    @v1.post("/files")
    async def upload(request: Request) -> dict[str, Any]:
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as e:  # not multipart, or a malformed one
            raise bad_request(f"The body must be multipart/form-data with `file` and `purpose` ({e}).") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("Missing required parameter: 'file'.", "file", "missing_required_parameter")
        if purpose not in PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(PURPOSES)} (got {str(purpose)[:32]!r}).", "purpose",
                              "invalid_value")
        content = await upload.read(max_file_bytes + 1)
        if len(content) > max_file_bytes:
            raise APIError(413, f"The file is larger than this server takes ({max_file_bytes} bytes, "
                           "--max-file-bytes).", "invalid_request_error", "file", "file_too_large")
        if not content.strip():
            raise bad_request("The file is empty.", "file", "invalid_value")
        store = batches.store
        return await asyncio.to_thread(store.put_file, new_id("file-"), tenant(request),
                                       (upload.filename or "upload.jsonl")[:256], str(purpose), content)

    @v1.get("/files")
    async def list_files(request: Request) -> dict[str, Any]:
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'.", "order", "invalid_value")
        data, more = await asyncio.to_thread(batches.store.files, tenant(request), q.get("purpose"), q.get("after"),
                                             _limit(request, 10000, 10000), order == "desc")
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @v1.get("/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        found = await asyncio.to_thread(batches.store.file, file_id, tenant(request))
        if found is None:
            raise _file_not_found(file_id)
        return found

    @v1.delete("/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        if not await asyncio.to_thread(batches.store.delete_file, file_id, tenant(request)):
            raise _file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @v1.get("/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        content = await asyncio.to_thread(batches.store.content, file_id, tenant(request))
        if content is None:
            raise _file_not_found(file_id)
        return Response(content, media_type="application/octet-stream")

    @v1.post("/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        return await batches.create(tenant(request), await read_json(request))

    @v1.get("/batches")
    async def list_batches(request: Request) -> dict[str, Any]:
        return await batches.list(tenant(request), request.query_params.get("after"), _limit(request, 20, 100))

    @v1.get("/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        return await batches.get(batch_id, tenant(request))

    @v1.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        return await batches.cancel(batch_id, tenant(request))
