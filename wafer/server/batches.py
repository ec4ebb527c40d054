"""The Batch API's batches: an input file of requests made into lines, run at background priority
through the server's own endpoints, their results written as they finish and gathered into an output
file and an error file in OpenAI's format.

A batch goes validating -> in_progress -> finalizing -> completed; cancel makes it cancelling, then
cancelled (with the files of what ran); it is expired when its 24 hours pass first, and failed when
its file holds no line at all. A bad line (not JSON, no custom_id, another endpoint, a request the
endpoint refuses) fails alone, into the error file. A server that stops leaves a batch's unfinished
lines without a result; the next server to start on the same store runs them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from wafer import untrusted_json
from wafer.errors import APIError, bad_request
from wafer.server.batch_store import BatchStore

log = logging.getLogger("wafer.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOW = "24h"  # the only window OpenAI offers
WINDOW_SECONDS = 24 * 3600
FINAL = ("completed", "failed", "expired", "cancelled")
# Seconds before a line the server could not take (429: its queue full; 503: shutting down, a stage
# down) is tried again: such a line has no result yet, and is not failed for the server's state.
RETRY_SECONDS = 1.0
WRITE_TRIES = 5  # writes of results tried before the batch fails

# A line's request, run through an endpoint: (url, body, owner) -> (HTTP status, JSON body).
Execute = Callable[[str, dict[str, Any], "str | None"], Awaitable[tuple[int, dict[str, Any]]]]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _not_found(bid: str) -> APIError:
    return APIError(404, f"No batch found with id '{bid}'.", "invalid_request_error", "batch_id", "not_found")


def line_error(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error file's line for a request that never reached an endpoint."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_lines(content: bytes, endpoint: str) -> list[tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]]:
    """The input file's lines as (custom_id, request body, error line): each non-blank line a
    request `{"custom_id", "method": "POST", "url": endpoint, "body": {...}}`, or its error."""
    out: list[tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"Line {number}"
        try:
            item = untrusted_json.loads(raw)
        except ValueError as e:
            out.append((None, None, line_error(None, "invalid_json_line",
                                               f"{where} is not valid JSON ({getattr(e, 'msg', None) or e}).")))
            continue
        if not isinstance(item, dict):
            out.append((None, None, line_error(None, "invalid_request", f"{where} is not a JSON object.")))
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            out.append((None, None, line_error(None, "missing_required_parameter",
                                               f"{where} has no custom_id (a non-empty string).")))
            continue
        if custom_id in seen:
            out.append((custom_id, None, line_error(custom_id, "duplicate_custom_id",
                                                    f"{where}: custom_id '{custom_id[:64]}' is on an earlier line too.")))
            continue
        seen.add(custom_id)
        if item.get("method", "POST") != "POST":
            out.append((custom_id, None, line_error(custom_id, "invalid_method", f"{where}: method must be POST.")))
        elif item.get("url") != endpoint:
            out.append((custom_id, None, line_error(custom_id, "mismatched_url",
                                                    f"{where}: url must be the batch's endpoint, {endpoint}.")))
        elif not isinstance(item.get("body"), dict):
            out.append((custom_id, None, line_error(custom_id, "invalid_request", f"{where}: body must be an object.")))
        else:
            out.append((custom_id, item["body"], None))
    return out


def _tokens(body: dict[str, Any]) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return (int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0),
            int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0))


class Batches:
    """The batches of one server: creating, reading and cancelling them, and running each as a task
    of the server's loop, their lines through `execute`, at most `window` at a time in all (so that
    however many batches run, their lines never fill the engine's queue, whose limit turns
    interactive requests away with a 429)."""

    def __init__(self, store: Callable[[], BatchStore], execute: Execute, window: int) -> None:
        self._store = store
        self.execute = execute
        self.window = window
        self.slots = asyncio.Semaphore(window)
        self.tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def store(self) -> BatchStore:
        return self._store()

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    # --- the API ------------------------------------------------------------------------------
    async def create(self, owner: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(input_file_id, str):
            raise bad_request("Missing required parameter: 'input_file_id'.", "input_file_id", "missing_required_parameter")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint", "invalid_value")
        if body.get("completion_window") != COMPLETION_WINDOW:
            raise bad_request(f"completion_window must be '{COMPLETION_WINDOW}'.", "completion_window", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
            raise bad_request("metadata must be at most 16 string pairs (keys of 64 characters at most, values of "
                              "512).", "metadata", "invalid_value")
        store = self.store
        found = await self._call(store.file, input_file_id, owner)
        if found is None:
            raise APIError(404, f"No such File object: {input_file_id}", "invalid_request_error", "input_file_id",
                           "not_found")
        if found["purpose"] != "batch":
            raise bad_request(f"File {input_file_id} has purpose '{found['purpose']}'; a batch's input has purpose "
                              "'batch'.", "input_file_id", "invalid_value")
        content = await self._call(store.content, input_file_id, owner)
        lines = await self._call(parse_lines, content, endpoint)
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": COMPLETION_WINDOW, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + WINDOW_SECONDS, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None, "metadata": metadata,
        }
        if not lines:
            batch.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                {"code": "empty_file", "message": "The input file has no request line (or is not UTF-8 text).",
                 "param": None, "line": None}]})
        await self._call(store.put_batch, batch, owner, lines)
        if lines:
            self.start(batch["id"])
        return await self.get(batch["id"], owner)

    async def get(self, bid: str, owner: str | None) -> dict[str, Any]:
        found = await self._call(self.store.batch, bid, owner)
        if found is None:
            raise _not_found(bid)
        return found

    async def list(self, owner: str | None, after: str | None, limit: int) -> dict[str, Any]:
        data, more = await self._call(self.store.batches, owner, after, limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    async def cancel(self, bid: str, owner: str | None) -> dict[str, Any]:
        batch = await self.get(bid, owner)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] in FINAL:
            raise APIError(409, f"Batch {bid} is {batch['status']} and cannot be cancelled.", "invalid_request_error",
                           None, "batch_not_cancellable")
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        await self._call(self.store.save_batch, batch)
        task = self.tasks.get(bid)
        if task is not None:
            task.cancel()
        self.start(bid)  # ends it as cancelled once the running lines are stopped
        return batch

    # --- running ------------------------------------------------------------------------------
    def start(self, bid: str) -> None:
        previous = self.tasks.get(bid)
        task = asyncio.get_running_loop().create_task(self._run(bid, previous))
        self.tasks[bid] = task
        task.add_done_callback(lambda t: self.tasks.pop(bid, None) if self.tasks.get(bid) is t else None)

    async def resume(self) -> None:
        """Run the batches a server stopped before they ended (its lines with a result stay done)."""
        for bid in await self._call(self.store.unfinished):
            if bid not in self.tasks:
                log.info("resuming batch %s", bid)
                self.start(bid)

    async def close(self) -> None:
        """Stop every batch's task: their running lines are aborted and keep no result."""
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, bid: str, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:  # a cancelled run: its lines stop first
            await asyncio.gather(previous, return_exceptions=True)
        store = self.store
        batch = await self._call(store.batch, bid, None, True)
        if batch is None:
            return
        owner = await self._call(store.owner, bid)
        try:
            if batch["status"] in ("validating", "in_progress"):
                if batch["status"] == "validating":
                    batch.update(status="in_progress", in_progress_at=int(time.time()))
                    await self._call(store.save_batch, batch)
                if not await self._lines(bid, batch, owner):
                    batch.update(status="expired", expired_at=int(time.time()))
                    await self._finalize(batch, "expired")
                    return
                batch.update(status="finalizing", finalizing_at=int(time.time()))
                await self._call(store.save_batch, batch)
            if batch["status"] == "finalizing":
                batch["completed_at"] = int(time.time())
                await self._finalize(batch, "completed")
            elif batch["status"] == "cancelling":
                batch["cancelled_at"] = int(time.time())
                await self._finalize(batch, "cancelled")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the server stays up; the batch says why it stopped
            log.exception("batch %s failed", bid)
            batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [
                {"code": "server_error", "message": f"The batch stopped on an internal error ({type(e).__name__}).",
                 "param": None, "line": None}]})
            await self._call(store.save_batch, batch)

    async def _lines(self, bid: str, batch: dict[str, Any], owner: str | None) -> bool:
        """Run every line without a result, `window` at a time; False when the batch expired first
        (its lines not run then have an error line each)."""
        store = self.store
        todo = deque(await self._call(store.pending, bid))
        url = batch["endpoint"]
        expired = False
        # Results are written by one writer, in a thread, all those that came meanwhile in one
        # transaction, while the workers go on to their next lines: they then submit those together,
        # into one step, rather than one a step as each write returns; and SQLite has one writer.
        unwritten: list[tuple[Any, ...]] = []
        writer: list[asyncio.Future[None]] = []

        async def flush() -> None:
            while unwritten:
                rows = unwritten[:]
                del unwritten[:]
                for attempt in range(WRITE_TRIES):
                    try:
                        await self._call(store.finish_lines, bid, rows)
                        break
                    except Exception as e:  # a database busy past its timeout, say: the rows wait and go again
                        if attempt == WRITE_TRIES - 1:
                            raise
                        log.warning("batch %s: writing %d results failed (%s); retrying", bid, len(rows), e)
                        await asyncio.sleep(RETRY_SECONDS)

        def write(*args: Any) -> None:
            unwritten.append(args)
            if not writer or writer[0].done():
                writer[:] = [asyncio.ensure_future(flush())]

        async def worker() -> None:
            nonlocal expired
            while todo:
                line, custom_id, body = todo.popleft()
                if time.time() >= batch["expires_at"]:
                    expired = True
                    write(line, False, line_error(custom_id, "batch_expired", "This request could not be executed "
                                                  "before the completion window expired."))
                    continue
                while True:
                    async with self.slots:
                        status, answer = await self.execute(url, body, owner)
                    if status not in (429, 503):
                        break
                    await asyncio.sleep(RETRY_SECONDS)
                result = {"id": new_id("batch_req_"), "custom_id": custom_id,
                          "response": {"status_code": status, "request_id": new_id("req_"), "body": answer},
                          "error": None}
                write(line, 200 <= status < 300, result, *_tokens(answer))

        workers = [asyncio.ensure_future(worker()) for _ in range(self.window)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            while writer and not writer[0].done() or unwritten:  # every result kept before the files are made
                if not writer or writer[0].done():
                    writer[:] = [asyncio.ensure_future(flush())]
                await asyncio.gather(writer[0], return_exceptions=True)
        if writer and not writer[0].cancelled() and writer[0].exception() is not None:
            raise writer[0].exception()  # type: ignore[misc]  # results lost: the batch fails, saying so
        return not expired

    async def _finalize(self, batch: dict[str, Any], status: str) -> None:
        """Write the output and error files of the lines with a result, and end the batch so."""
        store = self.store
        owner = await self._call(store.owner, batch["id"])
        output, errors = await self._call(store.results, batch["id"])
        for content, key, name in ((output, "output_file_id", "output"), (errors, "error_file_id", "error")):
            if content and batch.get(key) is None:
                fid = new_id("file-")
                await self._call(store.put_file, fid, owner, f"{batch['id']}_{name}.jsonl", "batch_output", content)
                batch[key] = fid
        batch["status"] = status
        await self._call(store.save_batch, batch)
