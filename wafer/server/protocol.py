"""Request bodies of the OpenAI API, validated so that each mistake names its parameter.

Numbers are strict (a string is not a temperature) and fields we do not know are accepted and
ignored, as OpenAI-compatible clients send many.
"""

from __future__ import annotations

import re

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from wafer.server.errors import APIError, bad_request

Float = Annotated[float, Field(strict=True)]
Int = Annotated[int, Field(strict=True)]
Bool = Annotated[bool, Field(strict=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url", "input_audio", "file", "refusal"]


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    # Checked when absent too: a tool message answers one call, and OpenAI refuses one that names none.
    tool_call_id: str | None = Field(default=None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise ValueError("messages with role 'tool' must have a 'tool_call_id'")
        return value

    @model_validator(mode="after")
    def _content_present(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if not isinstance(part, TextPart):
                raise ValueError(f"content parts of type {part.type!r} are not supported by this text-only model")
            parts.append(part.text)
        return "".join(parts)


class _Sampling(_Body):
    model: str
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=128)] = 1
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    # A torch generator takes 64 bits (as vLLM bounds it); n choices seed with seed + their index.
    seed: Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # OpenAI's key for requests that share what is cached for them: here, whose earlier outputs suffix
    # drafts may draw on (requests without one share theirs).
    prompt_cache_key: Annotated[str, Field(strict=True, max_length=256)] | None = None
    # Extensions that vLLM and llama.cpp also accept.
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0, le=10.0)] | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    # wafer's own: draft by n-gram prompt lookup for this request, for answers that copy their input.
    prompt_lookup: Bool = False

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and (v == "" or (isinstance(v, list) and any(s == "" for s in v))):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # ASCII digits only, and few enough for int(): str.isdigit() also takes '²', and int()
            # refuses over 4,300 digits.
            if not re.fullmatch(r"-?[0-9]{1,12}", key):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Bool | None = None


class ResponseFormatText(_Body):
    type: Literal["text"]


class ResponseFormatJsonObject(_Body):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    response_format: Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                               Field(discriminator="type")] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: Bool = False
    logprobs: Annotated[int, Field(strict=True, ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # the legacy API's default


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """pydantic's location as OpenAI spells a parameter: messages[0].role"""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        union_branch = text[:1].isupper() or "[" in text or "function-" in text or text in ("str", "list[str]")
        discriminator = i == 1 and loc[0] == "response_format" and text in ("text", "json_object", "json_schema")
        if union_branch or discriminator:
            continue
        out += ("." if out else "") + text
    return out or None


def parse_body(model: type[_Body], body: object) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # Of a union's failed branches, the one that got past the type check says most.
        err = sorted(e.errors(), key=lambda x: (x["type"].endswith("_type"), -len(x["loc"])))[0]
        param = _param_path(tuple(err["loc"]))
        kind = err["type"]
        if kind == "missing":
            msg = f"Missing required parameter: '{param}'."
        elif kind == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        else:
            what = err["msg"].removeprefix("Value error, ")
            msg = f"Invalid value for '{param}': {what}." if param else f"Invalid request: {what}."
        raise APIError(400, msg, "invalid_request_error", param, "missing_required_parameter" if kind == "missing"
                       else "invalid_value") from None
