"""A door's request → RequestSpec, or InvalidField naming the field that is wrong.

The checks are door-neutral (`prompt_from_text`, `prompt_from_ids`, `prompt_from_messages`, `build_spec`), so gRPC,
the OpenAI API and the offline `LLM` reject the same inputs with the same words; `validate` adapts a gRPC request.
Text is bounded by characters before it is tokenized: no text longer than max_model_len x the tokenizer's longest
token can fit, so a huge prompt is refused at once instead of costing seconds of tokenizer time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from proto import serving_pb2 as pb
from proto.structured import grammar_error
from proto.wire import SamplingOptions, StructuredOutput
from scheduler_node.api.sampling import SamplingFields, StructuredFields
from scheduler_node.core.kv.precision import KV_PRECISIONS
from scheduler_node.core.request import RequestSpec
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.priority import DEFAULT_PRIORITY, INT32, PriorityConfig

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_ID_LENGTH = 256
MAX_MESSAGES = 1024
DEFAULTS = PriorityConfig()  # no named ranges, DEFAULT_PRIORITY
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries
MAX_BIAS = 100.0  # |bias| at most (OpenAI's range)
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| at most (OpenAI's range)
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_CHOICES = 256
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema's JSON text, a regex, or the choices together
MAX_JSON_DEPTH = 128  # objects and arrays nested in a JSON schema (Python's own parser gives up near 1,000)


class InvalidField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


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
    if not ids:
        raise InvalidField(name, "must not be empty")
    if len(ids) >= max_model_len:  # refused by its length before a walk over (maybe millions of) ids
        _fits(list(ids), max_model_len, name)
    ids = list(ids)
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidField(name, f"token id {bad!r} is outside [0, {tokenizer.vocab_size})")
    return _fits(ids, max_model_len, name)


# What a door answers for `messages` when the model has no template; vllm-client falls back to raw text on it.
NO_CHAT_TEMPLATE = "the model has no chat template; send a prompt instead"


def prompt_from_messages(
    messages: Sequence[dict[str, Any]],
    tokenizer: ModelTokenizer,
    max_model_len: int,
    name: str = "messages",
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if not messages:
        raise InvalidField(name, "must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise InvalidField(name, f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        if not m.get("role"):
            raise InvalidField(f"{name}[{i}].role", "must not be empty")
    chars = sum(len(m.get("content") or "") for m in messages) + len(json.dumps(tools or []))
    limit = max_prompt_chars(tokenizer, max_model_len)
    if chars > limit:
        raise InvalidField(name, f"{chars} characters cannot fit in max_model_len {max_model_len} (at most {limit})")
    if not tokenizer.has_chat_template:
        raise InvalidField(name, NO_CHAT_TEMPLATE)
    try:
        ids = tokenizer.apply_chat_template([dict(m) for m in messages], tools)
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
    tokenizer: ModelTokenizer,  # token ids are checked against its vocabulary, bad words and grammars use it
    request_id: str = "",
    priority: int = DEFAULT_PRIORITY,
    cache_salt: str = "",
    prefix: str = "",
    kv_precision: str = "",
    compact_tokens: int = 0,
) -> RequestSpec:
    """The request the engine runs; InvalidField names the first wrong field (`prefix` + its name).
    `compact_tokens`: the tokens the engine's compact KV pool holds (0: it has none), the longest a request with
    `kv_precision="compact"` may grow."""
    if len(request_id) > MAX_ID_LENGTH:
        raise InvalidField("request_id", f"longer than {MAX_ID_LENGTH} characters")
    if len(cache_salt) > MAX_ID_LENGTH:
        raise InvalidField("cache_salt", f"longer than {MAX_ID_LENGTH} characters")
    precision = check_kv_precision(kv_precision, compact_tokens, len(prompt_ids))
    if precision == "compact":
        max_model_len = min(max_model_len, compact_tokens)
    max_tokens = _max_tokens(s.max_tokens, len(prompt_ids), max_model_len, prefix)
    _check_sampling(s, prefix)
    temperature, top_p, top_k, n = s.temperature, s.top_p, s.top_k, s.n
    vocab = tokenizer.vocab_size
    sampling = SamplingOptions(
        temperature,
        top_p,
        top_k,
        s.seed,
        s.logprobs,
        min_p=_in_range(s.min_p, 0.0, 1.0, prefix + "min_p"),
        repetition_penalty=_repetition_penalty(s.repetition_penalty, prefix),
        frequency_penalty=_in_range(s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, prefix + "frequency_penalty"),
        presence_penalty=_in_range(s.presence_penalty, -MAX_PENALTY, MAX_PENALTY, prefix + "presence_penalty"),
        logit_bias=_logit_bias(s.logit_bias, vocab, prefix + "logit_bias"),
        bad_words=_bad_words(s.bad_words, tokenizer, prefix + "bad_words"),
        min_tokens=_min_tokens(s.min_tokens, max_tokens, prefix),
        prompt_logprobs=_prompt_logprobs(s.prompt_logprobs, prefix),
        structured=None if s.structured is None else _structured(s.structured, tokenizer, prefix + "structured"),
    )
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=[x for x in s.stop if x],
        ignore_eos=s.ignore_eos,
        n=n,
        priority=priority,
        cache_salt=cache_salt,
        stop_token_ids=_token_ids(s.stop_token_ids, vocab, MAX_STOP_TOKEN_IDS, prefix + "stop_token_ids"),
        kv_precision=precision,
        speculate=s.speculate,
    )


def _max_tokens(given: int | None, prompt_tokens: int, max_model_len: int, prefix: str) -> int:
    """The request's max_tokens: what it gives, else the room its prompt leaves; InvalidField past that room."""
    room = max_model_len - prompt_tokens
    max_tokens = room if given is None else given
    if max_tokens < 1:
        raise InvalidField(prefix + "max_tokens", f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise InvalidField(
            prefix + "max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})",
        )
    return max_tokens


def _check_sampling(s: SamplingFields, prefix: str) -> None:
    """The sampling fields' ranges and bounds (the rest are checked where they are converted)."""
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidField(prefix + "temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:  # NaN fails too
        raise InvalidField(prefix + "top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < -1:
        raise InvalidField(prefix + "top_k", f"must be -1 (off), 0 (off) or positive, got {s.top_k}")
    if not 1 <= s.n <= MAX_N:
        raise InvalidField(prefix + "n", f"must be in [1, {MAX_N}], got {s.n}")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidField(prefix + "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidField(prefix + "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    if any(len(x) > MAX_STOP_CHARS for x in s.stop):
        raise InvalidField(prefix + "stop", f"a stop string is longer than {MAX_STOP_CHARS} characters")


def check_kv_precision(value: str, compact_tokens: int, prompt_tokens: int) -> str:
    """A request's KV precision ("" means auto); compact only on an engine whose compact pool holds its prompt."""
    precision = value or "auto"
    if precision not in KV_PRECISIONS:
        raise InvalidField("kv_precision", f"must be one of {', '.join(KV_PRECISIONS)}, got {value!r}")
    if precision == "compact" and not compact_tokens:
        raise InvalidField("kv_precision", "compact needs an engine with a compact KV pool (--kv-compact-fraction > 0)")
    if precision == "compact" and prompt_tokens >= compact_tokens:
        raise InvalidField(
            "kv_precision", f"compact: the prompt ({prompt_tokens} tokens) fills the compact KV pool ({compact_tokens})"
        )
    return precision


def _in_range(value: float, low: float, high: float, name: str) -> float:
    if not low <= value <= high:  # NaN fails too
        raise InvalidField(name, f"must be in [{low:g}, {high:g}], got {value}")
    return float(value)


def _repetition_penalty(value: float, prefix: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise InvalidField(prefix + "repetition_penalty", f"must be a finite number > 0 (1: off), got {value}")
    return float(value)


def _min_tokens(value: int, max_tokens: int, prefix: str) -> int:
    if not 0 <= value <= max_tokens:
        raise InvalidField(prefix + "min_tokens", f"must be in [0, max_tokens = {max_tokens}], got {value}")
    return value


def _prompt_logprobs(value: int | None, prefix: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidField(prefix + "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _token_ids(ids: Sequence[int], vocab: int, limit: int, name: str) -> list[int]:
    if len(ids) > limit:
        raise InvalidField(name, f"at most {limit} token ids, got {len(ids)}")
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidField(name, f"token id {bad!r} is outside [0, {vocab})")
    return sorted(set(ids))


def _logit_bias(bias: Mapping[int, float], vocab: int, name: str) -> dict[int, float]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidField(name, f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        token = _bias_token(token, vocab, name)
        if not isinstance(value, (int, float)) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise InvalidField(name, f"token {token}: bias must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}")
        out[token] = float(value)
    return out


def _bias_token(token: Any, vocab: int, name: str) -> int:
    """A logit_bias key: a token id, or its decimal text (JSON object keys are strings)."""
    if isinstance(token, str) and token.strip().lstrip("-").isdigit():
        token = int(token)
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise InvalidField(name, f"token id {token!r} is outside [0, {vocab})")
    return token


def _bad_words(words: Sequence[str], tokenizer: ModelTokenizer, name: str) -> list[list[int]]:
    """Each word's token sequences, alone and after a space, as vLLM bans them (mid-text words carry the space)."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidField(name, f"at most {MAX_BAD_WORDS} words, got {len(words)}")
    sequences: list[list[int]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidField(name, f"each word must be non-blank text of at most {MAX_BAD_WORD_CHARS} characters")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _structured(fields: StructuredFields, tokenizer: ModelTokenizer, name: str) -> StructuredOutput:
    given = [k for k in ("json", "regex", "choice") if getattr(fields, k) is not None]
    given += ["json_object"] if fields.json_object else []
    if len(given) != 1:
        raise InvalidField(name, f"exactly one of json, regex, choice or json_object, got {given or 'none'}")
    kind = given[0]
    structured = StructuredOutput(kind, _structured_spec(fields, kind, f"{name}.{kind}"))
    error = grammar_error(structured, tokenizer.grammar_tokenizer)
    if error:
        raise InvalidField(f"{name}.{kind}", error.strip().splitlines()[0])
    return structured


def _structured_spec(fields: StructuredFields, kind: str, name: str) -> str:
    if kind == "json_object":
        return ""
    if kind == "regex":
        spec = fields.regex or ""
    elif kind == "choice":
        choices = list(fields.choice or [])
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise InvalidField(name, f"must be 1 to {MAX_CHOICES} non-empty strings")
        spec = json.dumps(choices)
    else:
        spec = _schema_text(fields.json, name)
    if not spec:
        raise InvalidField(name, "must not be empty")
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise InvalidField(name, f"longer than {MAX_GRAMMAR_CHARS} characters")
    return spec


def _schema_text(schema: str | Mapping[str, Any] | None, name: str) -> str:
    if isinstance(schema, str) and len(schema) > MAX_GRAMMAR_CHARS:  # before parsing it
        raise InvalidField(name, f"longer than {MAX_GRAMMAR_CHARS} characters")
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
    except RecursionError:  # Python's parser recurses: a text nested ~1,000 deep exhausts it
        raise InvalidField(name, f"nested deeper than {MAX_JSON_DEPTH} objects and arrays") from None
    except ValueError as exc:
        raise InvalidField(name, f"not JSON: {exc}") from None
    if not isinstance(parsed, Mapping):
        raise InvalidField(name, "a JSON schema must be a JSON object")
    _check_depth(parsed, name)
    return json.dumps(parsed)


def _check_depth(value: Any, name: str) -> None:
    """Refuse JSON whose objects and arrays nest deeper than MAX_JSON_DEPTH (walked without recursion: json.dumps
    and the grammar compiler recurse)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (Mapping, list)):
                if depth >= MAX_JSON_DEPTH:
                    raise InvalidField(name, f"nested deeper than {MAX_JSON_DEPTH} objects and arrays")
                stack.append((child, depth + 1))


def priority_from(given: int | str | None, header: str | None, table: PriorityConfig = DEFAULTS) -> int:
    """The request's own priority, else the x-priority header's, else the default (`table`: the door's default and
    named ranges, settings/priority.py). Either may be a number or a range's name (`realtime`)."""
    if isinstance(given, int):
        return given
    if given is not None:
        return _priority_text(given, table, "")
    if header is None:
        return table.default_priority
    return _priority_text(header, table, "the x-priority header ")


def _priority_text(text: str, table: PriorityConfig, where: str) -> int:
    """A priority given as text: a number in int32's range, or the name of one of `table`'s ranges."""
    shown = text if len(text) <= 40 else text[:40] + "..."
    try:
        value = int(text)
    except ValueError:
        named = table.named(text.strip())
        if named is not None:
            return named
        ranges = ", ".join(str(r) for r in table.ranges) or "none (--priority-ranges)"
        raise InvalidField(
            "priority", f"{where}must be an integer or a named range ({ranges}), got {shown!r}"
        ) from None
    if not INT32[0] <= value <= INT32[1]:  # a body's priority is an int32 too
        raise InvalidField("priority", f"{where}must be in [{INT32[0]}, {INT32[1]}], got {shown}")
    return value


# ---- the gRPC door


def validate(
    request: pb.GenerateRequest,
    tokenizer: ModelTokenizer,
    max_model_len: int,
    priority_header: str | None = None,
    compact_tokens: int = 0,  # what the engine's compact KV pool holds (0: none)
    priorities: PriorityConfig = DEFAULTS,  # the default priority and the named ranges
) -> RequestSpec:
    """A gRPC GenerateRequest → RequestSpec (sampling fields are named `sampling.<field>`)."""
    s = request.sampling
    fields = SamplingFields.gather(lambda name: _given(s, name), structured=_structured_fields(s))
    if len(request.request_id) > MAX_ID_LENGTH:  # before any tokenizer work
        raise InvalidField("request_id", f"longer than {MAX_ID_LENGTH} characters")
    return build_spec(
        _prompt_ids(request, tokenizer, max_model_len),
        fields,
        max_model_len,
        tokenizer=tokenizer,
        request_id=request.request_id,
        priority=_priority(request, priority_header, priorities),
        cache_salt=request.cache_salt,
        prefix="sampling.",
        kv_precision=request.kv_precision,
        compact_tokens=compact_tokens,
    )


def _given(message: pb.SamplingParams, name: str) -> Any:
    """A proto field's value, None when the message has no such field or an optional one is unset."""
    f = message.DESCRIPTOR.fields_by_name.get(name)
    if f is None or (f.has_presence and not message.HasField(name)):
        return None
    return getattr(message, name)


def _structured_fields(s: pb.SamplingParams) -> StructuredFields | None:
    which = s.WhichOneof("structured")
    if which == "json":
        return StructuredFields(json=s.json)
    if which == "regex":
        return StructuredFields(regex=s.regex)
    if which == "choice":
        return StructuredFields(choice=list(s.choice.choices))
    if which == "json_object" and s.json_object:
        return StructuredFields(json_object=True)
    return None


def _priority(request: pb.GenerateRequest, header: str | None, table: PriorityConfig = DEFAULTS) -> int:
    return priority_from(request.priority if request.HasField("priority") else None, header, table)


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
