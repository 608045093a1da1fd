"""OpenAI request bodies → the engine's RequestSpecs, through the door-neutral checks of api/validation.py.

Runs off the event loop (it tokenizes). Errors name the field as the client sent it: `top_logprobs`, not the
engine's `logprobs`; `prompt[2]` for the third of several prompts.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from proto.nesting import parse_nested
from proto.structured import grammar_error
from proto.wire import StructuredOutput
from scheduler_node.api.media import image_from_url, images_taken, with_images
from scheduler_node.api.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, MessageToolCall
from scheduler_node.api.tools import check_schemas
from scheduler_node.api.validation import (
    MAX_N,
    InvalidField,
    build_spec,
    prompt_from_ids,
    prompt_from_messages,
    prompt_from_text,
)
from scheduler_node.core.request import RequestSpec
from scheduler_node.text.images import ImagePrompts
from scheduler_node.text.tokenizer import ModelTokenizer


def chat_specs(
    req: ChatCompletionRequest,
    tokenizer: ModelTokenizer,
    max_model_len: int,
    request_id: str,
    priority: int,
    compact_tokens: int = 0,
) -> list[RequestSpec]:
    fields, renames = req.fields()
    plan = req.tool_plan()
    check_schemas(plan, lambda schema: grammar_error(StructuredOutput("json", schema), tokenizer.grammar_tokenizer))
    with _renamed(renames):
        messages = template_messages(req.messages)
        ids = prompt_from_messages(messages, tokenizer, max_model_len, tools=plan.template_tools)
        spec = build_spec(ids, fields, max_model_len, tokenizer=tokenizer, request_id=request_id,
                          priority=priority, cache_salt=req.cache_salt, kv_precision=req.kv_precision,
                          compact_tokens=compact_tokens)  # fmt: skip
    return [spec]


def chat_images(
    req: ChatCompletionRequest, specs: list[RequestSpec], prompts: ImagePrompts | None, max_model_len: int
) -> list[RequestSpec]:
    """The chat's image_url parts read, checked and attached to its spec (api/media.py); a chat without images
    is as it was."""
    parts = [(f"messages[{i}].content[{j}].image_url", url)
             for i, m in enumerate(req.messages) for j, url in m.image_urls]  # fmt: skip
    if not parts:  # (a multimodal model refuses placeholders typed without images, as HF does)
        return [with_images(s, [], [], prompts, max_model_len, "messages") for s in specs]
    prompts = images_taken(prompts, [f for f, _ in parts])  # the count checked before any image is decoded
    images = [image_from_url(url, field, prompts.local_path, prompts.max_pixels) for field, url in parts]
    return [with_images(s, images, [f for f, _ in parts], prompts, max_model_len, "messages") for s in specs]


def completion_specs(
    req: CompletionRequest,
    tokenizer: ModelTokenizer,
    max_model_len: int,
    request_id: str,
    priority: int,
    compact_tokens: int = 0,
) -> list[RequestSpec]:
    fields, renames = req.fields()
    prompts = req.prompt
    if len(prompts) * (fields.n or 1) > MAX_N:  # n alone out of range is n's error; several prompts share the bound
        field = "n" if len(prompts) == 1 else "prompt"
        raise InvalidField(field, f"{len(prompts)} prompts x n={fields.n or 1} exceeds {MAX_N} sequences")
    specs = []
    for i, prompt in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = prompt_from_text(prompt, tokenizer, max_model_len, name)
        else:
            ids = prompt_from_ids(prompt, tokenizer, max_model_len, name)
        one_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        with _renamed(renames):
            specs.append(build_spec(ids, fields, max_model_len, tokenizer=tokenizer, request_id=one_id,
                                    priority=priority, cache_salt=req.cache_salt, kv_precision=req.kv_precision,
                                    compact_tokens=compact_tokens))  # fmt: skip
    return specs


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates read them (HF's form: a call's arguments as an object, not JSON text)."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(m.tool_calls)]  # fmt: skip
        out.append(message)
    return out


def _template_call(call: MessageToolCall, name: str) -> dict[str, Any]:
    try:
        arguments = parse_nested(json.loads, call.function.arguments, name)
    except ValueError:  # not JSON, or nested too deeply to parse
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidField(f"{name}.function.arguments", "must be the JSON text of an object")
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


@contextlib.contextmanager
def _renamed(renames: dict[str, str]) -> Iterator[None]:
    """InvalidField under the name the client used for the field (`structured.json` → `response_format`)."""
    try:
        yield
    except InvalidField as exc:
        base = exc.field.split(".")[0]
        if base not in renames:
            raise
        raise InvalidField(renames[base], str(exc)[len(exc.field) + 2 :]) from None
