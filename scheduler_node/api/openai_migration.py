"""Live migration at the OpenAI door (issue 31), the same as at the gRPC door: a stream vllm-router sends with
`migratable: true` that a drain with migrate moves off this replica ends, instead of finishing, with one `migrated`
event carrying its state (no usage, no `[DONE]`); an unstreamed answer is what it had so far with that state
(`MIGRATED_HEADER`). The router sends the request again, with that event's data as
`resume`, to another replica, whose stream continues the same response: the same id and time, each choice from
where it stopped, one usage for the whole request, one finish_reason per choice. The state is the gRPC door's
(minivllm.v1.ResumeState, checked by api/resume.py), serialized and base64-encoded: never pickle. The router
splices the two streams into one (router/http_door.py, router/migration.py).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any

from google.protobuf.message import DecodeError
from starlette.responses import JSONResponse, Response

from proto import serving_pb2 as pb
from scheduler_node.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from scheduler_node.api.resume import resumed, state_message
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import RequestSpec

MIGRATED_EVENT = "event: migrated\ndata: "  # a server-sent event of its own type: no OpenAI client reads it
MIGRATED_HEADER = "x-minivllm-migrated"  # on an unstreamed answer that moved: {"resume": ..., "partial": ...}


def with_migration(
    body: ChatCompletionRequest | CompletionRequest, specs: list[RequestSpec], plain: bool, vocab_size: int
) -> list[RequestSpec]:
    """The specs with the request's migration fields. `migratable` holds for what the router can continue exactly:
    one prompt whose output is `plain` (a tool call or reasoning parser's state does not move), without prompt
    logprobs (the source sent them); other requests run on to their end in a drain, as before."""
    migratable = body.migratable and len(specs) == 1 and plain
    migratable = migratable and specs[0].sampling.prompt_logprobs is None and not specs[0].kv_produce
    specs = [dataclasses.replace(spec, migratable=migratable) for spec in specs]
    if body.resume is None:
        return specs
    if len(specs) != 1:
        raise InvalidField("resume", f"continues a request of one prompt, got {len(specs)}")
    try:
        states = pb.ResumeState.FromString(base64.b64decode(body.resume.states, validate=True))
    except (binascii.Error, DecodeError, ValueError):
        raise InvalidField("resume.states", "must be a base64-encoded minivllm.v1.ResumeState") from None
    if len(body.resume.text_offsets) > specs[0].n:
        raise InvalidField("resume.text_offsets", f"one per choice: at most {specs[0].n} (n)")
    spec = dataclasses.replace(specs[0], request_id=body.resume.request_id)
    return [resumed(spec, states, vocab_size, "resume.states")]


def migrated_params(
    request_id: str, created: int, states: list[SequenceResume], completion_tokens: int, text_offsets: list[int]
) -> dict[str, Any]:
    """What the router sends on as `resume` (ResumeParams) when a request moved: the response's id and time, its
    sequences' states, the completion tokens of those that had ended, each choice's characters so far."""
    message = pb.ResumeState(sequences=[state_message(s) for s in sorted(states, key=lambda s: s.index)])
    return {
        "request_id": request_id,
        "created": created,
        "states": base64.b64encode(message.SerializeToString()).decode(),
        "completion_tokens": completion_tokens,
        "text_offsets": text_offsets,
    }


def migrated_event(params: dict[str, Any]) -> str:
    """The last event of a stream that moved."""
    return f"{MIGRATED_EVENT}{json.dumps(params, separators=(',', ':'))}\n\n"


def migrated_answer(params: dict[str, Any], partial: dict[str, Any]) -> Response:
    """An unstreamed answer that moved: what it had so far, and what the router sends on as `resume`; the router
    merges the answers of the replicas it went through into one (router/http_migration.py)."""
    return JSONResponse({"resume": params, "partial": partial}, headers={MIGRATED_HEADER: "true"})
