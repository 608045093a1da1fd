"""The engine's deltas in OpenAI's shapes: chat.completion(.chunk) and text_completion, logprobs, usage.

Plain dicts, serialized once per chunk: a streamed token costs one small json.dumps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proto.wire import TokenLogprobs
from scheduler_node.api.chat_output import ChatOutput
from scheduler_node.engine.outputs import Delta
from scheduler_node.text.tokenizer import ModelTokenizer


@dataclass(slots=True)
class Choice:
    """One returned sequence as it grows (prompt i's sequence j is choice i * n + j)."""

    index: int
    prompt_ids: list[int]
    text: list[str] = field(default_factory=list)
    num_chars: int = 0  # of the text streamed so far (completions' text_offset)
    finish_reason: str | None = None
    logprobs: Any = None  # in the answer's shape, accumulated (non-streaming)
    started: bool = False  # chat: the role was sent
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's shape, when asked


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache held

    def add(self, delta: Delta, first_of_prompt: bool) -> None:
        if first_of_prompt:  # n sequences share one prompt: counted once, as OpenAI does
            self.prompt_tokens += delta.prompt_tokens
            self.cached_tokens += delta.cached_tokens
        self.completion_tokens += delta.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Shape:
    """What chat and completions share: the envelope of every answer and chunk."""

    object_name = ""
    chunk_name = ""

    def __init__(
        self, response_id: str, model: str, tokenizer: ModelTokenizer, want_logprobs: bool, want_prompt_logprobs: bool
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.want_prompt_logprobs = want_prompt_logprobs
        self.created = int(time.time())

    def envelope(self, name: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage.as_dict()
        return body

    def sse(self, choice: dict[str, Any] | None = None, usage: Usage | None = None) -> str:
        """One server-sent event: a chunk with one choice, or the closing usage chunk (no choices)."""
        body = self.envelope(self.chunk_name, [choice] if choice is not None else [], usage)
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def answer(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return self.envelope(self.object_name, [self.full_choice(c) for c in choices], usage)

    def prompt_logprobs(self, prompt_ids: list[int], logprobs: list[TokenLogprobs]) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself (rank None when outside the top) and the top alternatives."""
        out: list[dict[str, Any] | None] = [None]
        for token, lp in zip(prompt_ids[1:], logprobs):
            ranks = {t: rank for rank, (t, _) in enumerate(lp.top, 1)}
            entry = {str(token): self._ranked(token, lp.logprob, ranks.get(token))}
            for t, p in lp.top:
                entry.setdefault(str(t), self._ranked(t, p, ranks[t]))
            out.append(entry)
        return out

    def _ranked(self, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.tokenizer.token_text(token)}

    def news(self, delta: Delta) -> bool:
        """Does a chunk for this delta tell the client anything?"""
        return bool(delta.text or delta.finish_reason or (self.want_prompt_logprobs and delta.prompt_logprobs))

    def with_prompt_logprobs(self, choice: Choice, body: dict[str, Any], delta: Delta | None = None) -> dict[str, Any]:
        """prompt_logprobs in an answer's choice (always, when asked) or a chunk's (the one that brings them)."""
        if self.want_prompt_logprobs and (delta is None or delta.prompt_logprobs):
            body["prompt_logprobs"] = choice.prompt_logprobs
        return body

    def add(self, choice: Choice, delta: Delta) -> None:
        """Accumulate a delta into a non-streamed answer."""
        choice.text.append(delta.text)
        if self.want_logprobs and delta.logprobs:
            choice.logprobs = self.merge_logprobs(choice.logprobs, self.logprobs(choice, delta))
        choice.num_chars += len(delta.text)
        if delta.finish_reason:
            choice.finish_reason = delta.finish_reason

    def stream_choice(self, choice: Choice, delta: Delta) -> dict[str, Any] | None:
        """A chunk's choice for this delta; None when there is nothing to send."""
        raise NotImplementedError

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs(self, choice: Choice, delta: Delta) -> Any:
        raise NotImplementedError

    def merge_logprobs(self, total: Any, new: Any) -> Any:
        raise NotImplementedError


class ChatShape(Shape):
    """A chat's choices; with tools or a reasoning parser, each choice's text is read by its own ChatOutput
    (`outputs()` makes one, or None when the output is all content)."""

    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, *args: Any, outputs: Callable[[], ChatOutput | None] = lambda: None) -> None:
        super().__init__(*args)
        self.outputs = outputs
        self._outputs: dict[int, ChatOutput | None] = {}

    def output_of(self, choice: Choice) -> ChatOutput | None:
        if choice.index not in self._outputs:
            self._outputs[choice.index] = self.outputs()
        return self._outputs[choice.index]

    def stream_choice(self, choice: Choice, delta: Delta) -> dict[str, Any] | None:
        output = self.output_of(choice)
        message: dict[str, Any] = {"content": delta.text}
        finish_reason: str | None = delta.finish_reason or None
        if output is not None:
            piece = output.feed(delta.text, final=finish_reason is not None)
            message = {"content": piece.content} if piece.content or not (piece.tool_calls or piece.reasoning) else {}
            if piece.reasoning:
                message["reasoning_content"] = piece.reasoning
            if piece.tool_calls:
                message["tool_calls"] = piece.tool_calls
            finish_reason = _with_calls(finish_reason, output.called)
        news = message.get("content") or message.get("tool_calls") or message.get("reasoning_content") or finish_reason
        if choice.started and not (news or (self.want_prompt_logprobs and delta.prompt_logprobs)):
            return None
        if not choice.started:
            message["role"] = "assistant"
            choice.started = True
        logprobs = self.logprobs(choice, delta) if self.want_logprobs and delta.logprobs else None
        body = {
            "index": choice.index,
            "delta": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self.with_prompt_logprobs(choice, body, delta)

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason: str | None = choice.finish_reason
        output = self.output_of(choice)
        if output is not None:
            whole = output.result(text)
            message["content"] = whole.content
            if whole.reasoning is not None:
                message["reasoning_content"] = whole.reasoning
            if whole.tool_calls:
                message["tool_calls"] = whole.tool_calls
            finish_reason = _with_calls(finish_reason, bool(whole.tool_calls))
        return {
            "index": choice.index,
            "message": message,
            "logprobs": choice.logprobs if self.want_logprobs else None,
            "finish_reason": finish_reason,
        }

    def answer(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        body = super().answer(choices, usage)
        if self.want_prompt_logprobs:  # vLLM puts a chat's beside the choices (a chat has one prompt)
            body["prompt_logprobs"] = choices[0].prompt_logprobs
        return body

    def logprobs(self, choice: Choice, delta: Delta) -> dict[str, list[dict[str, Any]]]:
        return {
            "content": [
                {**self._token(token, lp.logprob), "top_logprobs": [self._token(t, p) for t, p in lp.top]}
                for token, lp in zip(delta.token_ids, delta.logprobs)
            ]
        }

    def merge_logprobs(self, total: Any, new: Any) -> Any:
        if total is None:
            return new
        total["content"] += new["content"]
        return total

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class CompletionShape(Shape):
    object_name = "text_completion"
    chunk_name = "text_completion"

    def stream_choice(self, choice: Choice, delta: Delta) -> dict[str, Any] | None:
        if not self.news(delta):
            return None
        logprobs = self.logprobs(choice, delta) if self.want_logprobs and delta.logprobs else None
        choice.num_chars += len(delta.text)
        body = {
            "index": choice.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason or None,
        }
        return self.with_prompt_logprobs(choice, body, delta)

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        body = {
            "index": choice.index,
            "text": "".join(choice.text),
            "logprobs": choice.logprobs if self.want_logprobs else None,
            "finish_reason": choice.finish_reason,
        }
        return self.with_prompt_logprobs(choice, body)

    def logprobs(self, choice: Choice, delta: Delta) -> dict[str, list[Any]]:
        texts = [self.tokenizer.token_text(t) for t in delta.token_ids]
        offsets, at = [], choice.num_chars
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob for lp in delta.logprobs],
            "top_logprobs": [_top(self.tokenizer, lp) for lp in delta.logprobs],
            "text_offset": offsets,
        }

    def merge_logprobs(self, total: Any, new: Any) -> Any:
        if total is None:
            return new
        for key in total:
            total[key] += new[key]
        return total


def _with_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason for an output that called tools and ended on its own."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _top(tokenizer: ModelTokenizer, lp: TokenLogprobs) -> dict[str, float]:
    return {tokenizer.token_text(t): p for t, p in lp.top}
