"""GenerateRequest → RequestSpec, or InvalidField naming the field that is wrong."""

from __future__ import annotations

import math
from dataclasses import dataclass

from proto import serving_pb2 as pb
from proto.wire import SamplingOptions
from scheduler_node.text.tokenizer import ModelTokenizer

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_ID_LENGTH = 256


class InvalidField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    n: int
    priority: int
    cache_salt: str = ""


DEFAULT_PRIORITY = 50


def validate(
    request: pb.GenerateRequest, tokenizer: ModelTokenizer, max_model_len: int, priority_header: str | None = None
) -> RequestSpec:
    if len(request.request_id) > MAX_ID_LENGTH:
        raise InvalidField("request_id", f"longer than {MAX_ID_LENGTH} characters")
    if len(request.cache_salt) > MAX_ID_LENGTH:
        raise InvalidField("cache_salt", f"longer than {MAX_ID_LENGTH} characters")
    prompt_ids = _prompt_ids(request, tokenizer)
    if len(prompt_ids) >= max_model_len:
        raise InvalidField(
            _input_field(request),
            f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}, leaving no room to generate",
        )
    s = request.sampling
    room = max_model_len - len(prompt_ids)
    max_tokens = s.max_tokens if s.HasField("max_tokens") else room
    if max_tokens < 1:
        raise InvalidField("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise InvalidField(
            "sampling.max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})",
        )
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidField("sampling.temperature", f"must be a finite number >= 0, got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:  # NaN fails too
        raise InvalidField("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = s.top_k if s.HasField("top_k") else -1
    if top_k < -1:
        raise InvalidField("sampling.top_k", f"must be -1 (off), 0 (off) or positive, got {top_k}")
    n = s.n if s.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise InvalidField("sampling.n", f"must be in [1, {MAX_N}], got {n}")
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidField("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidField("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    seed = s.seed if s.HasField("seed") else None
    return RequestSpec(
        request_id=request.request_id,
        prompt_token_ids=prompt_ids,
        sampling=SamplingOptions(temperature, top_p, top_k, seed, logprobs),
        max_tokens=max_tokens,
        stop=[x for x in s.stop if x],
        ignore_eos=s.ignore_eos,
        n=n,
        priority=_priority(request, priority_header),
        cache_salt=request.cache_salt,
    )


def _priority(request: pb.GenerateRequest, header: str | None) -> int:
    if request.HasField("priority"):
        return request.priority
    if header is None:
        return DEFAULT_PRIORITY
    try:
        return int(header)
    except ValueError:
        raise InvalidField("priority", f"the x-priority header must be an integer, got {header!r}") from None


def _input_field(request: pb.GenerateRequest) -> str:
    return request.WhichOneof("input") or "prompt"


def _prompt_ids(request: pb.GenerateRequest, tokenizer: ModelTokenizer) -> list[int]:
    which = request.WhichOneof("input")
    if which == "prompt":
        if not request.prompt:
            raise InvalidField("prompt", "must not be empty")
        return tokenizer.encode(request.prompt)
    if which == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        if not ids:
            raise InvalidField("prompt_token_ids", "must not be empty")
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidField("prompt_token_ids", f"token id {bad} is outside [0, {tokenizer.vocab_size})")
        return ids
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise InvalidField("messages", "must not be empty")
        for i, m in enumerate(messages):
            if not m["role"]:
                raise InvalidField(f"messages[{i}].role", "must not be empty")
        if not tokenizer.has_chat_template:
            raise InvalidField("messages", "the model has no chat template; send prompt instead")
        try:
            return tokenizer.apply_chat_template(messages)
        except Exception as exc:  # a template's raise_exception speaks about the messages
            raise InvalidField("messages", f"chat template rejected them: {exc}") from exc
    raise InvalidField("prompt", "one of prompt, prompt_token_ids or messages is required")
