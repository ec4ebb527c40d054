"""POST /v1/completions (the legacy text completions API)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from wafer.engine.sequence import SequenceOutput, TokenLogprob
from wafer.server.errors import bad_request
from wafer.server.generation import OFF_LOOP_BYTES, TEXT_HOLE, GenerationHandler, _Choice, off_loop, sse, text_event
from wafer.server.protocol import CompletionRequest
from wafer.server.streaming import EventStreamResponse


class CompletionHandler(GenerationHandler):
    def _legacy_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            tok, _ = self._token_text(lp.token_id)
            tokens.append(tok)
            values.append(lp.logprob)
            tops.append({self._token_text(t)[0]: v for t, v in lp.top})
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


    async def completions(self, req: CompletionRequest, request: Request) -> JSONResponse | EventStreamResponse:
        if req.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        prompts = await off_loop(len(await request.body()) > OFF_LOOP_BYTES, self._prompts, req.prompt)
        tok = self.m.tokenizer
        jobs = []
        echoes = []
        for ids in prompts:
            limit = self._limit(len(ids), req.output_limit, "prompt")
            for i in range(req.n):
                jobs.append((ids, self._params(req, limit, i, req.logprobs)))
                echoes.append(tok.decode(ids) if req.echo else "")
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
                "system_fingerprint": self.m.fingerprint}
        n_prompt = sum(len(p) for p in prompts)
        streams = self._submit(jobs, rid, "prompt" if len(jobs) > (req.n or 1) else "n")
        if req.stream:
            return EventStreamResponse(self._completion_stream(streams, head, n_prompt, req.include_usage,
                                                                  req.logprobs is not None, echoes),
                                       on_disconnect=self._aborter(streams))
        choices = await self._collect(streams, request, rid, n_prompt)
        if choices is None:
            return JSONResponse({}, status_code=499)
        return JSONResponse({
            **head,
            "choices": [
                {
                    "index": c.index,
                    "text": echoes[c.index] + c.text,
                    "logprobs": self._legacy_logprobs(c.logprobs, 0) if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": self._usage(n_prompt, choices),
        }, headers={"x-request-id": rid})

    def _prompts(self, prompt: Any) -> list[list[int]]:
        tok = self.m.tokenizer
        if isinstance(prompt, str):
            prompts = [self._encode(prompt, "prompt")]
        elif prompt and all(isinstance(x, int) for x in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(x, str) for x in prompt):
            prompts = [self._encode(p, "prompt") for p in prompt]
        elif prompt and all(isinstance(x, list) for x in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise bad_request("prompt must be a string, a list of strings or a list of token ids", "prompt")
        vocab = tok.vocab_size
        for p in prompts:
            if not p:
                raise bad_request("prompt must not be empty", "prompt")
            if any(not 0 <= t < vocab for t in p):
                raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        return prompts

    async def _completion_stream(self, streams, head: dict[str, Any], n_prompt: int, include_usage: bool,
                                 want_lp: bool, echoes: list[str]) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
        def event(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            obj = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return obj

        texts = [text_event(event(i, TEXT_HOLE)) for i in range(len(streams))]

        def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
            if finish is None and logprobs is None:
                return texts[index](text)  # the chunk of nearly every token
            return sse(event(index, text, finish, logprobs))

        def render(c: _Choice, out: SequenceOutput, offset: int) -> list[str]:
            lines = []
            if out.text or (want_lp and out.logprobs):
                lines.append(chunk(c.index, out.text, None,
                                   self._legacy_logprobs(out.logprobs, offset) if want_lp else None))
            if out.finished:
                lines.append(chunk(c.index, "", c.finish_reason))
            return lines

        opening = [chunk(i, echo) for i, echo in enumerate(echoes) if echo]
        async for line in self._sse_stream(streams, head, n_prompt, include_usage, opening, render):
            yield line
