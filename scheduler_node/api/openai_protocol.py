"""The OpenAI API's request bodies as pydantic models: types are checked here (strictly, unknown fields refused,
as OpenAI does); ranges and limits are checked by api/validation.py, the same checks every door runs.

Fields OpenAI defines that this server does not implement are accepted only at their neutral value (no `echo`, no
`suffix`), so a client that sets them learns so instead of getting other output.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from scheduler_node.api.request_bounds import lone_surrogate_at
from scheduler_node.api.sampling import SamplingFields, StructuredFields
from scheduler_node.api.tools import NamedToolChoice, Tool, ToolPlan, tool_plan
from scheduler_node.api.validation import InvalidField


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise PydanticCustomError("stop_type", "must be a string or a list of strings")


def _prompts(value: Any) -> list[str | list[int]]:
    """A completion's prompt(s): a string, a list of strings, token ids, or a list of token-id lists."""

    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        return [value]
    if ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
        return value
    raise PydanticCustomError(
        "prompt_type", "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
    )


# What an image part becomes in the message's text: LLaVA's placeholder, which the model's tokenizer holds as one
# token and scheduler_node/text/images.py expands to the image's tokens.
IMAGE_PLACEHOLDER = "<image>"


def _content(value: Any) -> str:
    """A message's content: a string, or a list of text and image_url parts (joined, each image as its
    placeholder; ChatMessage keeps their URLs); audio is not supported."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") == "image_url" and _image_url(part) is not None:
                texts.append(IMAGE_PLACEHOLDER)
                continue
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise PydanticCustomError(
                    "content_part",
                    "only parts of type 'text' with a string 'text', or 'image_url' with an object "
                    "{'url': string}, are supported",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise PydanticCustomError("content_type", "must be a string or a list of text and image_url parts")


def _image_url(part: dict[str, Any]) -> str | None:
    """An image_url part's URL (`{"image_url": {"url": ...}}`, or the URL string itself); None when malformed."""
    inner = part.get("image_url")
    url = inner.get("url") if isinstance(inner, dict) else inner
    return url if isinstance(url, str) and url else None


def _neutral_only(*allowed: Any) -> BeforeValidator:
    """A field this server does not implement: accepted only at one of its neutral values."""

    def check(value: Any) -> Any:
        if value not in allowed:
            shown = " or ".join(json.dumps(a) for a in allowed if a is not None)
            raise PydanticCustomError("unsupported", "not supported by this server; leave it out or send {shown}",
                                      {"shown": shown})  # fmt: skip
        return value

    return BeforeValidator(check)


# Integers as wide as the gRPC contract's (int32; seeds int64): the wire to the workers carries no bigger ones.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


def _priority(value: object) -> object:
    """A number in int32's range, or a name (checked against --priority-ranges where the request is built); checked
    here so an error names `priority` itself, not a member of the union (pydantic's `priority.constrained-int`)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**31) <= value <= 2**31 - 1:
        raise ValueError(f"must be in [{-(2**31)}, {2**31 - 1}], got {value}")
    if value is not None and not isinstance(value, (int, str)) or isinstance(value, bool):
        raise ValueError(f"must be a number or a name of the priority ranges, got {type(value).__name__}")
    return value


Priority = Annotated[int | str | None, BeforeValidator(_priority)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StopStrings = Annotated[list[str], BeforeValidator(_stop_strings)]
Prompts = Annotated[list[str | list[int]], BeforeValidator(_prompts)]
Content = Annotated[str, BeforeValidator(_content)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(_Strict):
    """A whole request body: no lone surrogate anywhere in it (JSON may escape one, Unicode text has none)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        at = lone_surrogate_at(data)
        if at is not None:  # openai_errors names `param` as the field
            raise PydanticCustomError("lone_surrogate", "holds a lone surrogate: not Unicode text", {"param": at})
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text, as the answer gave it


class MessageToolCall(BaseModel):
    """A call in an earlier assistant message, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message; fields a client echoes back from an earlier answer (refusal, reasoning_content) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: Content = ""
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # Its image_url parts, in order, as (index in the content list, URL); each one's placeholder is in `content`.
    image_urls: list[tuple[int, str]] = []

    @model_validator(mode="before")
    @classmethod
    def _images(cls, data: Any) -> Any:
        if isinstance(data, dict):
            content = data.get("content")
            parts = content if isinstance(content, list) else []
            urls = [
                (j, _image_url(p)) for j, p in enumerate(parts) if isinstance(p, dict) and p.get("type") == "image_url"
            ]
            data = {**data, "image_urls": [(j, u) for j, u in urls if u is not None]}
        return data


class JsonSchemaFormat(_Strict):
    name: str = ""
    description: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's structured output: text (no constraint), any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def fields(self) -> StructuredFields | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredFields(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidField("response_format.json_schema.schema", "required with type json_schema")
        return StructuredFields(json=self.json_schema.schema_)


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, a choice of strings, or any JSON object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False

    def fields(self) -> StructuredFields:
        return StructuredFields.gather(lambda name: getattr(self, "json_" if name == "json" else name))


class KVTransferParams(_Strict):
    """Disaggregated prefill/decode (vLLM's `kv_transfer_params`; the gRPC API's kv_handoff): `produce` asks this
    replica to hold the prompt's KV under a lease (its answer's `kv_transfer_params` says where), or `addresses`,
    `lease` (hex) and `blocks` name such a lease to pull from (scheduler_node/api/kv_handoff_fields.py)."""

    produce: bool = False
    addresses: list[str] = Field(default_factory=list)
    lease: str = ""
    blocks: list[Int32] = Field(default_factory=list)


class ResumeParams(_Strict):
    """Live migration through vllm-router (scheduler_node/api/openai_migration.py): a stream's `migrated` event,
    sent back as `resume` to the replica that continues it. `states` is a minivllm.v1.ResumeState, serialized and
    base64-encoded; the rest is what the client already got: the response's id and time, the completion tokens of
    sequences that ended before the move, each choice's characters so far (completions' text_offset)."""

    request_id: str = Field(min_length=1, max_length=256)
    created: Int64 = 0
    states: str = Field(min_length=1)
    completion_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    text_offsets: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(default_factory=list)


class _GenerationRequest(_Body):
    """What chat and completions share: OpenAI's sampling fields and vLLM's extensions."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 | None = None
    seed: Int64 | None = None
    stop: StopStrings = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and not used (OpenAI's abuse monitoring)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # token id -> bias; JSON object keys are strings, so keys are converted ("42" -> 42)
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    stop_token_ids: list[Int32] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int32 | None = None
    structured_outputs: StructuredOutputs | None = None
    ignore_eos: bool = False
    speculate: bool | None = None  # false: no speculative decoding for this request (a minivllm extension)
    # higher runs first, as in the gRPC API (vLLM's is the other way round); or a name of --priority-ranges
    priority: Priority = None
    cache_salt: str = ""
    kv_precision: str = ""  # auto (empty), full or compact: the format of the request's KV blocks
    kv_transfer_params: KVTransferParams | None = None  # disaggregated prefill/decode through the router
    migratable: bool = False  # live migration: a drain with migrate ends the stream with its state (vllm-router)
    resume: ResumeParams | None = None  # live migration: continue a stream another replica handed back

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "only allowed when stream is true")
        fields = type(self).model_fields
        return SamplingFields.gather(
            lambda name: getattr(self, name) if name in fields else None,
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured=self.structured(),
        )

    def structured(self) -> StructuredFields | None:
        if self.response_format is not None and self.structured_outputs is not None:
            raise InvalidField("structured_outputs", "send response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            return self.structured_outputs.fields()
        return None if self.response_format is None else self.response_format.fields()

    def renames(self) -> dict[str, str]:
        """Our field names → this request's (errors name what the client sent)."""
        return {"structured": "structured_outputs" if self.structured_outputs is not None else "response_format"}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def fields(self) -> tuple[SamplingFields, dict[str, str]]:
        """The sampling fields, and the names this request gave them (for errors) where they differ from ours."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "needs logprobs: true")
        renames = {**self.renames(), "logprobs": "top_logprobs"}
        if self.tool_plan().structured() is not None:
            renames["structured"] = "tool_choice"
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            max_tokens = self.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        return self.sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None), renames

    def tool_plan(self) -> ToolPlan:
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredFields | None:
        """A required or named tool_choice is enforced as structured output (the calls' JSON schema)."""
        tools = self.tool_plan().structured()
        if tools is None:
            return super().structured()
        if self.response_format is not None or self.structured_outputs is not None:
            given = "response_format" if self.response_format is not None else "structured_outputs"
            raise InvalidField("tool_choice", f"a {self.tool_plan().mode} tool_choice cannot go with {given}")
        return tools


class CompletionRequest(_GenerationRequest):
    prompt: Prompts
    max_tokens: Int32 | None = 16  # OpenAI's default for completions
    logprobs: Int32 | None = None
    echo: Annotated[Any, _neutral_only(False)] = False
    best_of: Int32 | None = None  # only equal to n (one sample per sequence)
    suffix: Annotated[Any, _neutral_only(None, "")] = None

    def fields(self) -> tuple[SamplingFields, dict[str, str]]:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidField("best_of", f"must equal n ({self.n or 1}): every sampled sequence is returned")
        return self.sampling(self.max_tokens, self.logprobs), self.renames()


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
