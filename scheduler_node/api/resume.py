"""A migrated request's states, as the doors read them (gRPC's GenerateRequest.resume, the OpenAI door's `resume`:
api/openai_migration.py): checked field by field against the request they resume, then handed to the engine as
`RequestSpec.resume` (core/migration.py)."""

from __future__ import annotations

import dataclasses

from proto import serving_pb2 as pb
from scheduler_node.api.kv_handoff_fields import read_source, source_message
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore

MAX_HELD_CHARS = 4096  # held-back text is at most the longest stop string (request_bounds keep those short)
MAX_PENDING_TOKENS = 8  # an incomplete UTF-8 character spans at most four byte tokens


def with_resume(request: pb.GenerateRequest, spec: RequestSpec, vocab_size: int) -> RequestSpec:
    """`spec` with the request's migration fields: `migratable`, and the states of a resumed request."""
    spec = dataclasses.replace(spec, migratable=request.migratable)
    return resumed(spec, request.resume, vocab_size) if request.HasField("resume") else spec


def resumed(spec: RequestSpec, resume: pb.ResumeState, vocab_size: int, name: str = "resume") -> RequestSpec:
    """`spec` continuing the sequences `resume` names (both doors: `name` is the field's name in errors)."""
    states = resume.sequences
    if not states:
        raise InvalidField(f"{name}.sequences", "must not be empty (a resumed request runs at least one sequence)")
    seen: set[int] = set()
    resumes = tuple(_sequence(s, f"{name}.sequences[{i}]", spec, vocab_size, seen) for i, s in enumerate(states))
    return dataclasses.replace(spec, resume=resumes)


def taken_back(engine: EngineCore, request_id: str, resumes: bool) -> bool:
    """A request this draining replica migrated off comes back (vllm-router found no other replica for it): it runs
    on here (from the KV still leased for it, or by recompute), rather than be lost."""
    if not resumes or not engine.draining or engine.failed or engine.gave_up:
        return False
    return engine.takes_back(request_id)


def _sequence(state: pb.SequenceState, name: str, spec: RequestSpec, vocab_size: int, seen: set[int]) -> SequenceResume:
    if not 0 <= state.index < spec.n:
        raise InvalidField(f"{name}.index", f"must be in [0, {spec.n}) (sampling.n), got {state.index}")
    if state.index in seen:
        raise InvalidField(f"{name}.index", f"sequence {state.index} is resumed twice")
    seen.add(state.index)
    outputs = list(state.output_token_ids)
    if len(outputs) >= spec.max_tokens:
        detail = f"{len(outputs)} tokens: a sequence that reached max_tokens ({spec.max_tokens}) has ended"
        raise InvalidField(f"{name}.output_token_ids", detail)
    _in_vocab(outputs, vocab_size, f"{name}.output_token_ids")
    pending = list(state.pending_token_ids)
    if len(pending) > MAX_PENDING_TOKENS or pending != outputs[len(outputs) - len(pending) :]:
        detail = f"must be the last tokens of output_token_ids (at most {MAX_PENDING_TOKENS})"
        raise InvalidField(f"{name}.pending_token_ids", detail)
    if len(state.held_text) > MAX_HELD_CHARS:
        raise InvalidField(f"{name}.held_text", f"longer than {MAX_HELD_CHARS} characters")
    prompt = len(spec.prompt_token_ids)
    if state.prompt_tokens and state.prompt_tokens != prompt:
        detail = f"the prompt was {state.prompt_tokens} tokens where it ran and is {prompt} here (another model?)"
        raise InvalidField(f"{name}.prompt_tokens", detail)
    if not 0 <= state.cached_tokens <= prompt:
        raise InvalidField(f"{name}.cached_tokens", f"must be in [0, {prompt}] (the prompt's tokens)")
    source = read_source(state.kv_source, f"{name}.kv_source") if state.HasField("kv_source") else None
    if source is not None and source.tokens >= prompt + len(outputs):
        detail = f"{source.tokens} positions: more than the {prompt + len(outputs) - 1} before the last token"
        raise InvalidField(f"{name}.kv_source.tokens", detail)
    return SequenceResume(state.index, outputs, state.held_text, pending, prompt, state.cached_tokens, source)


def _in_vocab(ids: list[int], vocab_size: int, name: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidField(name, f"token id {bad} is outside [0, {vocab_size})")


def state_message(state: SequenceResume) -> pb.SequenceState:
    """A migrated sequence's state, for its last GenerateResponse."""
    message = pb.SequenceState(
        index=state.index,
        output_token_ids=state.output_token_ids,
        held_text=state.held_text,
        pending_token_ids=state.pending_token_ids or [],
        prompt_tokens=state.prompt_tokens,
        cached_tokens=state.cached_tokens,
    )
    if state.kv_source is not None:
        message.kv_source.CopyFrom(source_message(state.kv_source))
    return message
