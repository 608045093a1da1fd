"""The engine's deltas in OpenAI's shapes: chat.completion(.chunk) and text_completion, logprobs, usage.

Plain dicts, serialized once per chunk: a streamed token costs one small json.dumps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from proto.wire import TokenLogprobs
from scheduler_node.engine.outputs import Delta
from scheduler_node.text.tokenizer import ModelTokenizer


@dataclass(slots=True)
class Choice:
    """One returned sequence as it grows (prompt i's sequence j is choice i * n + j)."""

    index: int
    text: list[str] = field(default_factory=list)
    num_chars: int = 0  # of the text streamed so far (completions' text_offset)
    finish_reason: str | None = None
    logprobs: Any = None  # in the answer's shape, accumulated (non-streaming)
    started: bool = False  # chat: the role was sent


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: Delta, first_of_prompt: bool) -> None:
        if first_of_prompt:  # n sequences share one prompt: counted once, as OpenAI does
            self.prompt_tokens += delta.prompt_tokens
        self.completion_tokens += delta.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Shape:
    """What chat and completions share: the envelope of every answer and chunk."""

    object_name = ""
    chunk_name = ""

    def __init__(self, response_id: str, model: str, tokenizer: ModelTokenizer, want_logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
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
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def stream_choice(self, choice: Choice, delta: Delta) -> dict[str, Any] | None:
        if not (delta.text or delta.finish_reason or not choice.started):
            return None
        message: dict[str, Any] = {"content": delta.text}
        if not choice.started:
            message["role"] = "assistant"
            choice.started = True
        logprobs = self.logprobs(choice, delta) if self.want_logprobs and delta.logprobs else None
        return {
            "index": choice.index,
            "delta": message,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason or None,
        }

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": choice.logprobs if self.want_logprobs else None,
            "finish_reason": choice.finish_reason,
        }

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
        if not (delta.text or delta.finish_reason):
            return None
        logprobs = self.logprobs(choice, delta) if self.want_logprobs and delta.logprobs else None
        choice.num_chars += len(delta.text)
        return {
            "index": choice.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason or None,
        }

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": "".join(choice.text),
            "logprobs": choice.logprobs if self.want_logprobs else None,
            "finish_reason": choice.finish_reason,
        }

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


def _top(tokenizer: ModelTokenizer, lp: TokenLogprobs) -> dict[str, float]:
    return {tokenizer.token_text(t): p for t, p in lp.top}
