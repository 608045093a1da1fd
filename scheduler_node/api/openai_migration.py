"""Live migration at the OpenAI door (issue 31), the same as at the gRPC door: a stream vllm-router sends with
`migratable: true` that a drain with migrate moves off this replica ends, instead of finishing, with one `migrated`
event carrying its state (no usage, no `[DONE]`). The router sends the request again, with that event's data as
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
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from proto import serving_pb2 as pb
from scheduler_node.api.openai_protocol import ChatCompletionRequest, CompletionRequest, ResumeParams
from scheduler_node.api.resume import resumed, state_message
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.request import RequestSpec

if TYPE_CHECKING:
    from scheduler_node.api.openai_runs import Run

MIGRATED_EVENT = "event: migrated\ndata: "  # a server-sent event of its own type: no OpenAI client reads it


def with_migration(
    body: ChatCompletionRequest | CompletionRequest, specs: list[RequestSpec], plain: bool, vocab_size: int
) -> list[RequestSpec]:
    """The specs with the request's migration fields. `migratable` holds for what the router can continue exactly:
    a stream of one prompt whose output is `plain` (a tool call or reasoning parser's state does not move), without
    prompt logprobs (the source sent them); other requests run on to their end in a drain, as before."""
    migratable = body.migratable and body.stream and len(specs) == 1 and plain
    migratable = migratable and specs[0].sampling.prompt_logprobs is None and not specs[0].kv_produce
    specs = [dataclasses.replace(spec, migratable=migratable) for spec in specs]
    if body.resume is None:
        return specs
    if len(specs) != 1 or not body.stream:
        raise InvalidField("resume", "continues the stream of one prompt: one prompt, stream: true")
    try:
        states = pb.ResumeState.FromString(base64.b64decode(body.resume.states, validate=True))
    except (binascii.Error, DecodeError, ValueError):
        raise InvalidField("resume.states", "must be a base64-encoded minivllm.v1.ResumeState") from None
    if len(body.resume.text_offsets) > specs[0].n:
        raise InvalidField("resume.text_offsets", f"one per choice: at most {specs[0].n} (n)")
    spec = dataclasses.replace(specs[0], request_id=body.resume.request_id)
    return [resumed(spec, states, vocab_size, "resume.states")]


def continue_run(run: Run, params: ResumeParams) -> None:
    """A resumed run goes on as the response its client has: its id and time, each choice's role sent and its
    characters counted, the completion tokens of the sequences that ended before the move in its usage."""
    run.shape.response_id = params.request_id
    run.shape.created = params.created or run.shape.created
    for choice in run.choices:
        choice.started = True
    for choice, chars in zip(run.choices, params.text_offsets):
        choice.num_chars = chars
    run.usage.completion_tokens = params.completion_tokens


def migrated_event(run: Run) -> str:
    """The last event of a stream that moved: its state, which the router sends on as `resume`."""
    states = pb.ResumeState(sequences=[state_message(s) for s in sorted(run.migrated, key=lambda s: s.index)])
    body = {
        "request_id": run.specs[0].request_id,
        "created": run.shape.created,
        "states": base64.b64encode(states.SerializeToString()).decode(),
        "completion_tokens": run.usage.completion_tokens,
        "text_offsets": [choice.num_chars for choice in run.choices],
    }
    return f"{MIGRATED_EVENT}{json.dumps(body, separators=(',', ':'))}\n\n"
