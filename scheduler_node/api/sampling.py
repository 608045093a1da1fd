"""The sampling options a request may set, declared once: their names, types and defaults.

Every door converts its own request into `SamplingFields` by name (`SamplingFields.gather`): the gRPC door from
`serving.proto`'s SamplingParams, the OpenAI door from its pydantic body, the offline API from `SamplingParams`.
The checks are `api/validation.py`'s `build_spec`, the same for every door, and the defaults shared with the
workers are the wire's (`proto/wire.py` SamplingOptions). A new option is a field here, its check in `build_spec`,
and its name in each door's own schema; `tests/scheduler_node/api/test_sampling_doors.py` fails while a door
lacks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from proto.wire import SamplingOptions

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_WIRE = SamplingOptions()  # the defaults the workers sample with
T = TypeVar("T", bound="DataclassInstance")


def gather(cls: type[T], given: Callable[[str], Any], fixed: Mapping[str, Any]) -> T:
    """An instance of the dataclass `cls` from a door's request: `given(name)` is the door's value of each field
    (None where the client left it out: the default holds), `fixed` the values a door works out itself (they
    win). Sequences and maps are copied into the field's own container type."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = fixed[f.name] if f.name in fixed else given(f.name)
        if value is None:
            continue
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory(value)  # type: ignore[call-arg]  # tuple or dict: both copy an iterable
        values[f.name] = value
    return cls(**values)


@dataclass(frozen=True, slots=True)
class StructuredFields:
    """A constraint on the output text as a door received it; exactly one field is set. The OpenAI door's
    response_format maps to `json` (json_schema) or `json_object`."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema: its text, or parsed
    regex: str | None = None
    choice: Sequence[str] | None = None
    json_object: bool = False

    @classmethod
    def gather(cls, given: Callable[[str], Any]) -> StructuredFields:
        return gather(cls, given, {})


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """A request's sampling options, door-neutral; a field a client left out keeps its default."""

    max_tokens: int | None = None  # None: the rest of the context (max_model_len - prompt)
    temperature: float = _WIRE.temperature  # 0: greedy
    top_p: float = _WIRE.top_p
    top_k: int = _WIRE.top_k  # -1 or 0: off
    n: int = 1  # sequences sampled from the one prompt
    logprobs: int | None = _WIRE.logprobs  # the sampled token's logprob plus this many top alternatives
    seed: int | None = _WIRE.seed
    stop: Sequence[str] = field(default_factory=tuple)  # strings that end the output (cut from its text)
    ignore_eos: bool = False
    min_p: float = _WIRE.min_p
    repetition_penalty: float = _WIRE.repetition_penalty  # 1: off
    frequency_penalty: float = _WIRE.frequency_penalty
    presence_penalty: float = _WIRE.presence_penalty
    min_tokens: int = _WIRE.min_tokens  # eos and stop_token_ids cannot end the output before this many tokens
    stop_token_ids: Sequence[int] = field(default_factory=tuple)  # besides eos
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id (or its decimal text) -> bias
    bad_words: Sequence[str] = field(default_factory=tuple)
    prompt_logprobs: int | None = _WIRE.prompt_logprobs
    structured: StructuredFields | None = None
    speculate: bool = True  # False: never speculative decoding for this request (when the server has it on)

    @classmethod
    def gather(cls, given: Callable[[str], Any], **fixed: Any) -> SamplingFields:
        """A door's request by name: `given(name)` is its value of each field (None: left out), `fixed` the
        fields the door works out itself (renamed ones, the structured output)."""
        return gather(cls, given, fixed)
