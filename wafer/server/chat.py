"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from wafer.engine.constraints import GrammarError
from wafer.engine.sequence import SequenceOutput, TokenLogprob
from wafer.models.chat_template import TemplateError
from wafer.server.errors import bad_request
from wafer.server.generation import (
    OFF_LOOP_BYTES,
    TEXT_HOLE,
    _Choice,
    off_loop,
    sse,
    text_event,
)
from wafer.server.chat_reasoning import ReasonedChat
from wafer.server.protocol import ChatCompletionRequest
from wafer.server.streaming import EventStreamResponse
from wafer.server.tools import (
    OPEN,
    CallParser,
    check_schema,
    history_for_generic_template,
    history_for_tool_template,
    json_grammar,
    parse_reply,
    template_knows_tools,
    tool_grammar,
    tools_system_prompt,
)

class ChatHandler(ReasonedChat):
    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            tok, b = self._token_text(lp.token_id)
            top = []
            for tid, value in lp.top:
                t, tb = self._token_text(tid)
                top.append({"token": t, "logprob": value, "bytes": tb})
            content.append({"token": tok, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
        return {"content": content, "refusal": None}


    def _messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        messages = []
        for i, msg in enumerate(req.messages):
            try:
                text = msg.text()
            except ValueError as e:
                raise bad_request(str(e), f"messages[{i}].content") from None
            m: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": text}
            if msg.name:
                m["name"] = msg.name
            if msg.tool_calls:
                m["tool_calls"] = [tc.model_dump() for tc in msg.tool_calls]
                if msg.content is None:
                    m["content"] = ""
            if msg.tool_call_id:
                m["tool_call_id"] = msg.tool_call_id
            messages.append(m)
        return messages

    def _tools(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
        """The tools in force and the choice among them (none when tool_choice is 'none')."""
        choice: str | dict[str, Any] = "auto"
        if isinstance(req.tool_choice, str):
            choice = req.tool_choice
        elif req.tool_choice is not None:
            choice = req.tool_choice.model_dump()
        if not req.tools:
            if choice not in ("none", "auto"):
                raise bad_request("tool_choice requires tools", "tool_choice")
            return [], "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise bad_request("tool names must be unique", "tools")
        for i, t in enumerate(tools):
            if "parameters" in t["function"]:
                check_schema(t["function"]["parameters"], f"tools[{i}].function.parameters")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise bad_request(f"tool_choice names function {choice['function']['name']!r}, which is not in tools",
                              "tool_choice")
        return (tools, choice) if choice != "none" else ([], "none")

    def _grammar(self, req: ChatCompletionRequest, tools: list[dict[str, Any]],
                 choice: str | dict[str, Any]) -> str | None:
        if tools and not self.m.tool_grammar:
            return None
        if tools:
            special = self.m.engine.is_special(OPEN)
            grammar, param = tool_grammar(tools, choice, req.parallel_tool_calls, special), "tools"
        elif req.response_format is not None and req.response_format.type != "text":
            schema, strict = None, False
            param = "response_format"
            if req.response_format.type == "json_schema":
                param = "response_format.json_schema.schema"
                schema = check_schema(req.response_format.json_schema.schema_, param)
                strict = bool(req.response_format.json_schema.strict)
            try:
                grammar = json_grammar(schema, strict)
            except ValueError as e:  # what llguidance cannot read as JSON (an integer past 64 bits, say)
                raise bad_request(f"the schema cannot be compiled into a grammar: {e}", param) from None
        else:
            return None
        try:
            self.m.engine.check_grammar(grammar)
        except GrammarError as e:
            raise bad_request(f"the schema cannot be compiled into a grammar: {e}", param) from None
        return grammar

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                choice: str | dict[str, Any], **switches: Any) -> str:
        """`switches`: the template's own variables, such as `enable_thinking`."""
        template = self.m.chat_template
        try:
            # A template with tool support renders the calls and results of the history in the model's
            # own format, tools offered or not (tool_choice none, or a turn that no longer offers them):
            # Qwen2.5's merges consecutive results into one user turn and puts each call on lines of its own.
            if template_knows_tools(template.source):
                return template.render(history_for_tool_template(messages), add_generation_prompt=True,
                                       tools=tools or None, **switches)
            if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
                messages = history_for_generic_template(messages)
            if tools:
                note = tools_system_prompt(tools, choice)
                if messages and messages[0]["role"] == "system":
                    messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
                else:
                    messages = [{"role": "system", "content": note}, *messages]
            return template.render(messages, add_generation_prompt=True, **switches)
        except TemplateError as e:
            raise bad_request(f"The conversation cannot be rendered by this model's chat template: {e}",
                              "messages") from None

    def _prepare(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str | None, Any, list[int]]:
        """Tools, grammar (and its compiled matcher) and prompt ids: the work that grows with the
        request, done before the engine sees it."""
        tools, grammar, compiled, choice = self._constraints(req)
        ids = self._encode(self._render(self._messages(req), tools, choice), "messages", special=False)
        return tools, grammar, compiled, ids

    def _constraints(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str | None, Any,
                                                                 str | dict[str, Any]]:
        tools, choice = self._tools(req)
        grammar = self._grammar(req, tools, choice)
        try:
            compiled = self.m.engine.compile_grammar(grammar) if grammar is not None else None
        except GrammarError as e:
            raise bad_request(f"the schema cannot be compiled into a grammar: {e}",
                              "tools" if tools else "response_format") from None
        return tools, grammar, compiled, choice

    async def chat(self, req: ChatCompletionRequest, request: Request) -> JSONResponse | EventStreamResponse:
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        heavy = bool(req.tools or req.response_format) or len(await request.body()) > OFF_LOOP_BYTES
        if req.reasoning_effort is not None:
            return await self._reasoned(req, request, heavy)
        tools, grammar, compiled, ids = await off_loop(heavy, self._prepare, req)
        limit = self._limit(len(ids), req.output_limit, "messages")
        lp = (req.top_logprobs or 0) if req.logprobs else None
        jobs = []
        for i in range(req.n):
            params = self._params(req, limit, i, lp)
            params.grammar, params.compiled = grammar, compiled
            jobs.append((ids, params))
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": req.model, "system_fingerprint": self.m.fingerprint}
        streams = self._submit(jobs, rid)
        if req.stream:
            return EventStreamResponse(self._chat_stream(streams, head, len(ids), req.include_usage, lp is not None,
                                                            bool(tools)), on_disconnect=self._aborter(streams))
        choices = await self._collect(streams, request, rid, len(ids))
        if choices is None:
            return JSONResponse({}, status_code=499)
        return JSONResponse({
            **{"id": rid, "object": "chat.completion"}, **head,
            "choices": [self._choice(c, lp is not None, bool(tools)) for c in choices],
            "usage": self._usage(len(ids), choices),
            "service_tier": "default",
        }, headers={"x-request-id": rid})

    def _choice(self, c: _Choice, want_lp: bool, tools: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        finish = c.finish_reason
        if tools:
            # Complete calls whatever follows them; one cut by max_tokens is dropped (and logged), and
            # finish_reason stays "length" to say so.
            message["content"], calls, _ = parse_reply(c.text)
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message,
                "logprobs": self._chat_logprobs(c.logprobs) if want_lp else None, "finish_reason": finish}

    async def _chat_stream(self, streams, head: dict[str, Any], n_prompt: int, include_usage: bool,  # type: ignore[no-untyped-def]
                           want_lp: bool, tools: bool) -> AsyncIterator[str]:
        base = {"id": head["id"], "object": "chat.completion.chunk", **head}

        def event(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            obj = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return obj

        texts = [text_event(event(i, {"content": TEXT_HOLE})) for i in range(len(streams))]

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
            if finish is None and logprobs is None and len(delta) == 1 and "content" in delta:
                return texts[index](delta["content"])  # the chunk of nearly every token
            return sse(event(index, delta, finish, logprobs))

        parsers = [CallParser() if tools else None for _ in streams]

        def render(c: _Choice, out: SequenceOutput, _offset: int) -> list[str]:
            lps = self._chat_logprobs(out.logprobs) if want_lp and out.logprobs else None
            parser = parsers[c.index]
            deltas = parser.feed(out.text, final=out.finished) if parser else (
                [{"content": out.text}] if out.text else [])
            if lps is not None and not deltas:
                deltas = [{"content": ""}]
            lines = [chunk(c.index, delta, None, lps if k == 0 else None) for k, delta in enumerate(deltas)]
            if out.finished:
                finish = c.finish_reason
                if parser is not None and parser.calls and finish == "stop":
                    finish = "tool_calls"
                lines.append(chunk(c.index, {}, finish))
            return lines

        opening = [chunk(i, {"role": "assistant", "content": ""}) for i in range(len(streams))]
        async for line in self._sse_stream(streams, base, n_prompt, include_usage, opening, render):
            yield line
