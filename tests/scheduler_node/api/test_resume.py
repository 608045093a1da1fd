"""A migrated request's states as the gRPC door reads them (api/resume.py): each bad field is refused by name,
and a state survives its trip through the proto message."""

from __future__ import annotations

import pytest

from proto import serving_pb2 as pb
from proto.wire import SamplingOptions
from scheduler_node.api.resume import state_message, with_resume
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.kv.leases import KVSource
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import RequestSpec

pytestmark = pytest.mark.unit

VOCAB = 100
LEASE = bytes(range(16))
SOURCE = pb.KVHandoff(addresses=["127.0.0.1:5"], lease=LEASE, blocks=[0], tokens=4)
SPEC = RequestSpec("r", [5, 6, 7], SamplingOptions(), max_tokens=10, stop=[], ignore_eos=True, n=2, priority=50)


def resumed(*states: pb.SequenceState, migratable: bool = True) -> RequestSpec:
    request = pb.GenerateRequest(migratable=migratable, resume=pb.ResumeState(sequences=states))
    return with_resume(request, SPEC, VOCAB)


def test_a_state_round_trips_through_its_message() -> None:
    state = SequenceResume(1, [9, 8, 7], "ab", [7], 3, 2)
    spec = resumed(state_message(state))
    assert spec.resume == (state,) and spec.migratable
    with_kv = SequenceResume(0, [9, 8], "", [], 3, 0, KVSource(("127.0.0.1:5",), LEASE, (4,), 4))
    assert resumed(state_message(with_kv)).resume == (with_kv,)


def test_a_request_without_resume_only_says_whether_it_is_migratable() -> None:
    spec = with_resume(pb.GenerateRequest(), SPEC, VOCAB)
    assert (spec.migratable, spec.resume) == (False, ())
    assert with_resume(pb.GenerateRequest(migratable=True), SPEC, VOCAB).migratable


@pytest.mark.parametrize(
    ("states", "field"),
    [
        ((), "resume.sequences"),
        ((pb.SequenceState(index=2),), "resume.sequences[0].index"),  # n = 2
        ((pb.SequenceState(index=0), pb.SequenceState(index=0)), "resume.sequences[1].index"),
        ((pb.SequenceState(output_token_ids=[1] * 10),), "resume.sequences[0].output_token_ids"),  # max_tokens
        ((pb.SequenceState(output_token_ids=[1, VOCAB]),), "resume.sequences[0].output_token_ids"),
        ((pb.SequenceState(output_token_ids=[1, 2], pending_token_ids=[1]),), "resume.sequences[0].pending_token_ids"),
        ((pb.SequenceState(held_text="x" * 5000),), "resume.sequences[0].held_text"),
        ((pb.SequenceState(prompt_tokens=4),), "resume.sequences[0].prompt_tokens"),  # the prompt is 3 here
        ((pb.SequenceState(cached_tokens=4),), "resume.sequences[0].cached_tokens"),
        (
            (pb.SequenceState(kv_source=pb.KVHandoff(addresses=["a:1"], lease=b"x")),),
            "resume.sequences[0].kv_source.lease",
        ),
        # Positions up to the last token's at most (3 prompt + 1 output: 3).
        ((pb.SequenceState(output_token_ids=[1], kv_source=SOURCE),), "resume.sequences[0].kv_source.tokens"),
    ],
)
def test_a_bad_state_is_refused_naming_its_field(states: tuple[pb.SequenceState, ...], field: str) -> None:
    with pytest.raises(InvalidField) as exc:
        resumed(*states)
    assert exc.value.field == field, exc.value
