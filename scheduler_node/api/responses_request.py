"""POST /v1/responses, OpenAI's Responses API, stateless: a request is turned into the chat request it means
(`as_chat`) and runs as one; api/responses_shape.py writes the answer and the stream's events.

Nothing is stored: `store` is taken as false (OpenAI's default is true; `store: true` and `previous_response_id`
are refused, naming the field), so a conversation is sent whole each time, as `input` items: messages (text or
input_text / output_text parts), the model's earlier `function_call`s and their `function_call_output`s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler_node.api.openai_errors import OpenAIError, param_of
from scheduler_node.api.openai_protocol import ChatCompletionRequest, Int32, _Body
from scheduler_node.api.validation import InvalidField

ROLES = ("user", "assistant", "system", "developer")
# A chat field's name as a Responses request calls it (errors name what the client sent).
FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = ""
    description: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, not used


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    priority: Int32 | None = None  # as the chat door's

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one means; InvalidField naming this request's field."""
        if self.store:
            raise InvalidField("store", "this server keeps no responses: send store: false (or leave it out)")
        if self.previous_response_id is not None:
            raise InvalidField("previous_response_id", "this server keeps no responses: send the whole conversation")
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls", "priority"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(tool) for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            body["response_format"] = _response_format(text_format)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidField(param_of(tuple(first["loc"])), first["msg"]) from None

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            _add_item(out, item, f"input[{i}]")
        return out


def responses_error(exc: InvalidField | OpenAIError) -> OpenAIError:
    """An error of the chat request as the Responses request's: `messages[0].content` is `input[0].content`."""
    if isinstance(exc, InvalidField):
        exc = OpenAIError(400, str(exc), exc.field)
    param = exc.param or ""
    base = param.split(".")[0].split("[")[0]
    if base not in FIELD_NAMES:
        return exc
    renamed = FIELD_NAMES[base] + param[len(base) :]
    message = exc.message[len(param) :] if exc.message.startswith(param) else ": " + exc.message
    return OpenAIError(exc.status, renamed + message, renamed, exc.code)


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise InvalidField("text.format.schema", "required with type json_schema")
    return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.schema_}}


def _add_item(out: list[dict[str, Any]], item: dict[str, Any], name: str) -> None:
    """One input item as chat messages: a message, a function call (joined to the assistant message before it)
    or a function call's output (a tool message); reasoning items are skipped."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise InvalidField(f"{name}.role", f"must be one of {', '.join(ROLES)}")
        out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), name)})
    elif kind == "function_call":
        function = {"name": _string(item, "name", name), "arguments": _string(item, "arguments", name)}
        call = {"id": _string(item, "call_id", name), "type": "function", "function": function}
        if not (out and out[-1]["role"] == "assistant"):
            out.append({"role": "assistant", "content": ""})
        out[-1].setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, f"{name}.output")
        out.append({"role": "tool", "tool_call_id": _string(item, "call_id", name), "content": content})
    elif kind != "reasoning":
        raise InvalidField(f"{name}.type", "must be message, function_call, function_call_output or reasoning")


def _text(content: Any, name: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")):
                raise InvalidField(f"{name}.content[{j}]", "only input_text and output_text parts are supported")
            texts.append(_string(part, "text", f"{name}.content[{j}]"))
        return "\n".join(texts)
    raise InvalidField(f"{name}.content", "must be a string or a list of text parts")


def _string(item: dict[str, Any], key: str, name: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidField(f"{name}.{key}", "must be a string")
    return value
