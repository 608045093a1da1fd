"""A chat run in the Responses API's shapes: the `response` object (output items: a `message` with its
`output_text`, then `function_call`s), and its stream of typed events — response.created, output_item.added,
content_part.added, output_text.delta ... function_call_arguments.delta ... output_item.done, response.completed —
each `event: TYPE` with its JSON, numbered by `sequence_number`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from scheduler_node.api.chat_output import Piece
from scheduler_node.api.openai_errors import OpenAIError
from scheduler_node.api.openai_responses import ChatShape, Usage
from scheduler_node.api.openai_runs import Run
from scheduler_node.api.responses_request import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response as it grows: its output items, and the events that tell a stream each change."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.model = model
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.thought: dict[str, Any] | None = None  # the open reasoning item (with --reasoning-parser)
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its item
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def response(self, usage: Usage | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": self.status, "incomplete_details": self.incomplete, "error": None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "output": self.items, "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": None,
            "store": False, "temperature": b.temperature, "top_p": b.top_p, "truncation": "disabled",
            "tool_choice": b.tool_choice if isinstance(b.tool_choice, str) else _dump(b.tool_choice, "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "text": _dump(b.text, {"format": {"type": "text"}}),
            "usage": None if usage is None else _usage(usage),
        }  # fmt: skip

    def reasoning(self, piece: str) -> list[str]:
        """More of the model's reasoning: a `reasoning` item with `reasoning_text`, before the answer's items."""
        if not piece:
            return []
        events = []
        if self.thought is None:
            self.thought = {"type": "reasoning", "id": _id("rs"), "status": "in_progress", "summary": [],
                            "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
            self.items.append(self.thought)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.thought))
        self.thought["content"][0]["text"] += piece
        index = self.items.index(self.thought)
        return [*events, self.event("response.reasoning_text.delta", item_id=self.thought["id"], output_index=index,
                                    content_index=0, delta=piece)]  # fmt: skip

    def close_thought(self) -> list[str]:
        thought, self.thought = self.thought, None
        if thought is None:
            return []
        thought["status"] = "completed"
        index = self.items.index(thought)
        return [
            self.event("response.reasoning_text.done", item_id=thought["id"], output_index=index, content_index=0,
                       text=thought["content"][0]["text"]),
            self.event("response.output_item.done", output_index=index, item=thought),
        ]  # fmt: skip

    def text(self, piece: str) -> list[str]:
        if not piece:
            return []
        events = self.close_thought()
        if self.message is None:
            self.message = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                            "content": []}  # fmt: skip
            self.items.append(self.message)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.message))
            part = {"type": "output_text", "text": "", "annotations": []}
            self.message["content"].append(part)
            events.append(self._text_event("response.content_part.added", part=dict(part)))
        self.message["content"][0]["text"] += piece
        return [*events, self._text_event("response.output_text.delta", delta=piece)]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool_calls delta: a new call item, or more of its arguments."""
        events = [*self.close_thought(), *self.close_message()] if delta["index"] not in self.calls else []
        function = delta["function"]
        item = self.calls.get(delta["index"])
        if item is None:
            item = {"type": "function_call", "id": _id("fc"), "call_id": delta["id"], "name": function["name"],
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            self.calls[delta["index"]] = item
            self.items.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=function["arguments"]))  # fmt: skip
        return events

    def close_message(self) -> list[str]:
        message, self.message = self.message, None
        if message is None:
            return []
        message["status"] = "completed"
        text = message["content"][0]["text"]
        index = self.items.index(message)
        return [
            self.event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                       text=text),
            self.event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                       part=message["content"][0]),
            self.event("response.output_item.done", output_index=index, item=message),
        ]  # fmt: skip

    def finish(self, finish_reason: str | None, usage: Usage) -> list[str]:
        events = [*self.close_thought(), *self.close_message()]
        for item in self.calls.values():
            item["status"] = "completed"
            index = self.items.index(item)
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))  # fmt: skip
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=self.response(usage))]

    def _text_event(self, kind: str, **fields: Any) -> str:
        assert self.message is not None
        index = self.items.index(self.message)
        return self.event(kind, item_id=self.message["id"], output_index=index, content_index=0, **fields)


async def response_events(run: Run, builder: ResponseBuilder) -> AsyncIterator[str]:
    """The run as the Responses API's events (an engine failure: an `error` event)."""
    shape = run.shape
    assert isinstance(shape, ChatShape)
    yield builder.event("response.created", response=builder.response())
    yield builder.event("response.in_progress", response=builder.response())
    try:
        async for choice, delta in run.deltas():
            output = shape.output_of(choice)
            piece = Piece(content=delta.text) if output is None else output.feed(delta.text, bool(delta.finish_reason))
            for event in [*builder.reasoning(piece.reasoning), *builder.text(piece.content)]:
                yield event
            for call in piece.tool_calls:
                for event in builder.call(call):
                    yield event
            if delta.finish_reason:
                for event in builder.finish(delta.finish_reason, run.usage):
                    yield event
    except OpenAIError as exc:
        yield builder.event("error", code=exc.code, message=exc.message, param=exc.param)


def response_answer(run: Run, builder: ResponseBuilder, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat answer as the response."""
    (choice,) = chat["choices"]
    message = choice["message"]
    builder.reasoning(message.get("reasoning_content") or "")
    builder.text(message.get("content") or "")
    for index, call in enumerate(message.get("tool_calls") or []):
        builder.call({"index": index, **call})
    builder.finish(choice["finish_reason"], run.usage)
    return builder.response(run.usage)


def _dump(model: BaseModel | None, default: Any) -> Any:
    return default if model is None else model.model_dump(exclude_none=True, by_alias=True)


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
