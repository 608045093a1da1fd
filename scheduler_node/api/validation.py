"""A door's request → RequestSpec, or InvalidField naming the field that is wrong.

The checks are door-neutral (`prompt_from_text`, `prompt_from_ids`, `prompt_from_messages`, `build_spec`), so gRPC,
the OpenAI API and the offline `LLM` reject the same inputs with the same words; `validate` adapts a gRPC request.
Text is bounded by characters before it is tokenized: no text longer than max_model_len x the tokenizer's longest
token can fit, so a huge prompt is refused at once instead of costing seconds of tokenizer time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from proto import serving_pb2 as pb
from proto.wire import SamplingOptions
from scheduler_node.core.request import RequestSpec
from scheduler_node.text.tokenizer import ModelTokenizer

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_ID_LENGTH = 256
MAX_MESSAGES = 1024
DEFAULT_PRIORITY = 50


class InvalidField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """A request's sampling settings as a door received them; None where the client left a field out."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    logprobs: int | None = None
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False


def max_prompt_chars(tokenizer: ModelTokenizer, max_model_len: int) -> int:
    """Characters beyond which no text can fit in max_model_len tokens."""
    return max_model_len * tokenizer.max_token_chars


def prompt_from_text(
    text: str, tokenizer: ModelTokenizer, max_model_len: int, name: str = "prompt", add_special_tokens: bool = True
) -> list[int]:
    if not text:
        raise InvalidField(name, "must not be empty")
    limit = max_prompt_chars(tokenizer, max_model_len)
    if len(text) > limit:
        raise InvalidField(
            name, f"{len(text)} characters cannot fit in max_model_len {max_model_len} (at most {limit})"
        )
    return _fits(tokenizer.encode(text, add_special_tokens), max_model_len, name)


def prompt_from_ids(ids: Sequence[int], tokenizer: ModelTokenizer, max_model_len: int, name: str) -> list[int]:
    ids = list(ids)
    if not ids:
        raise InvalidField(name, "must not be empty")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidField(name, f"token id {bad!r} is outside [0, {tokenizer.vocab_size})")
    return _fits(ids, max_model_len, name)


def prompt_from_messages(
    messages: Sequence[dict[str, str]], tokenizer: ModelTokenizer, max_model_len: int, name: str = "messages"
) -> list[int]:
    if not messages:
        raise InvalidField(name, "must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise InvalidField(name, f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        if not m.get("role"):
            raise InvalidField(f"{name}[{i}].role", "must not be empty")
    chars = sum(len(m.get("content") or "") for m in messages)
    limit = max_prompt_chars(tokenizer, max_model_len)
    if chars > limit:
        raise InvalidField(name, f"{chars} characters cannot fit in max_model_len {max_model_len} (at most {limit})")
    if not tokenizer.has_chat_template:
        raise InvalidField(name, "the model has no chat template; send a prompt instead")
    try:
        ids = tokenizer.apply_chat_template([dict(m) for m in messages])
    except Exception as exc:  # a template's raise_exception speaks about the messages
        raise InvalidField(name, f"chat template rejected them: {exc}") from exc
    return _fits(ids, max_model_len, name)


def _fits(ids: list[int], max_model_len: int, name: str) -> list[int]:
    if len(ids) >= max_model_len:
        raise InvalidField(
            name, f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}, leaving no room to generate"
        )
    return ids


def build_spec(
    prompt_ids: list[int],
    s: SamplingFields,
    max_model_len: int,
    *,
    request_id: str = "",
    priority: int = DEFAULT_PRIORITY,
    cache_salt: str = "",
    prefix: str = "",
) -> RequestSpec:
    """The request the engine runs; InvalidField names the first wrong field (`prefix` + its name)."""
    if len(request_id) > MAX_ID_LENGTH:
        raise InvalidField("request_id", f"longer than {MAX_ID_LENGTH} characters")
    if len(cache_salt) > MAX_ID_LENGTH:
        raise InvalidField("cache_salt", f"longer than {MAX_ID_LENGTH} characters")
    room = max_model_len - len(prompt_ids)
    max_tokens = room if s.max_tokens is None else s.max_tokens
    if max_tokens < 1:
        raise InvalidField(prefix + "max_tokens", f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise InvalidField(
            prefix + "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})",
        )
    temperature = 1.0 if s.temperature is None else s.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidField(prefix + "temperature", f"must be a finite number >= 0, got {temperature}")
    top_p = 1.0 if s.top_p is None else s.top_p
    if not 0 < top_p <= 1:  # NaN fails too
        raise InvalidField(prefix + "top_p", f"must be in (0, 1], got {top_p}")
    top_k = -1 if s.top_k is None else s.top_k
    if top_k < -1:
        raise InvalidField(prefix + "top_k", f"must be -1 (off), 0 (off) or positive, got {top_k}")
    n = 1 if s.n is None else s.n
    if not 1 <= n <= MAX_N:
        raise InvalidField(prefix + "n", f"must be in [1, {MAX_N}], got {n}")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidField(prefix + "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidField(prefix + "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    if any(len(x) > MAX_STOP_CHARS for x in s.stop):
        raise InvalidField(prefix + "stop", f"a stop string is longer than {MAX_STOP_CHARS} characters")
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=SamplingOptions(temperature, top_p, top_k, s.seed, s.logprobs),
        max_tokens=max_tokens,
        stop=[x for x in s.stop if x],
        ignore_eos=s.ignore_eos,
        n=n,
        priority=priority,
        cache_salt=cache_salt,
    )


def priority_from(given: int | None, header: str | None) -> int:
    """The request's own priority, else the x-priority header's, else the default."""
    if given is not None:
        return given
    if header is None:
        return DEFAULT_PRIORITY
    try:
        return int(header)
    except ValueError:
        raise InvalidField("priority", f"the x-priority header must be an integer, got {header!r}") from None


# ---- the gRPC door


def validate(
    request: pb.GenerateRequest, tokenizer: ModelTokenizer, max_model_len: int, priority_header: str | None = None
) -> RequestSpec:
    """A gRPC GenerateRequest → RequestSpec (sampling fields are named `sampling.<field>`)."""
    s = request.sampling

    def given(name: str):  # type: ignore[no-untyped-def]
        return getattr(s, name) if s.HasField(name) else None

    fields = SamplingFields(
        max_tokens=given("max_tokens"),
        temperature=given("temperature"),
        top_p=given("top_p"),
        top_k=given("top_k"),
        n=given("n"),
        logprobs=given("logprobs"),
        seed=given("seed"),
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    if len(request.request_id) > MAX_ID_LENGTH:  # before any tokenizer work
        raise InvalidField("request_id", f"longer than {MAX_ID_LENGTH} characters")
    return build_spec(
        _prompt_ids(request, tokenizer, max_model_len),
        fields,
        max_model_len,
        request_id=request.request_id,
        priority=_priority(request, priority_header),
        cache_salt=request.cache_salt,
        prefix="sampling.",
    )


def _priority(request: pb.GenerateRequest, header: str | None) -> int:
    return priority_from(request.priority if request.HasField("priority") else None, header)


def _prompt_ids(request: pb.GenerateRequest, tokenizer: ModelTokenizer, max_model_len: int) -> list[int]:
    which = request.WhichOneof("input")
    if which == "prompt":
        return prompt_from_text(request.prompt, tokenizer, max_model_len)
    if which == "prompt_token_ids":
        return prompt_from_ids(request.prompt_token_ids.ids, tokenizer, max_model_len, "prompt_token_ids")
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        return prompt_from_messages(messages, tokenizer, max_model_len)
    raise InvalidField("prompt", "one of prompt, prompt_token_ids or messages is required")
