"""GenerateRequest.kv_handoff checked into the engine's fields (scheduler_node/api/kv_handoff_fields.py): a bad
lease, address list or block id, or a produce request a decode replica cannot serve, is refused naming the field."""

from __future__ import annotations

import pytest

from proto import serving_pb2 as pb
from scheduler_node.api.kv_handoff_fields import kv_fields, source_message
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.kv_handoff import KVSource

pytestmark = pytest.mark.unit

LEASE = bytes(range(16))


def request(**handoff: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(kv_handoff=pb.KVHandoff(**handoff))  # type: ignore[arg-type]


def test_produce_and_source_round_trip() -> None:
    assert kv_fields(pb.GenerateRequest(), 1, False) == {}
    assert kv_fields(request(produce=True), 1, True) == {"kv_produce": True}
    source = KVSource(("127.0.0.1:5000", "127.0.0.1:5001"), LEASE, (3, 1, 2))
    back = kv_fields(pb.GenerateRequest(kv_handoff=source_message(source)), 2, False)
    assert back == {"kv_source": source}


@pytest.mark.parametrize(
    ("handoff", "n", "serves", "field"),
    [
        ({"produce": True}, 1, False, "kv_handoff.produce: this replica serves no KV"),
        ({"produce": True}, 2, True, "kv_handoff.produce: a prefill for another replica has n = 1"),
        ({"produce": True, "lease": LEASE}, 1, True, "kv_handoff: produce asks"),
        ({"addresses": ["a:1"], "lease": b"short"}, 1, True, "kv_handoff.lease: must be 16 bytes"),
        ({"lease": LEASE, "blocks": [1]}, 1, True, "kv_handoff.addresses"),
        ({"addresses": ["a:1"], "lease": LEASE, "blocks": [-1]}, 1, True, "kv_handoff.blocks"),
    ],
)
def test_bad_handoffs_are_refused_naming_the_field(handoff: dict, n: int, serves: bool, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidField, match=field):
        kv_fields(request(**handoff), n, serves)
