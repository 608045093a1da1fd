"""GenerateRequest.kv_handoff and the OpenAI door's kv_transfer_params checked into the engine's fields
(scheduler_node/api/kv_handoff_fields.py): a bad lease, address list or block id, or a produce request a decode
replica cannot serve (or a streamed one over HTTP), is refused naming the field."""

from __future__ import annotations

import pytest

from proto import serving_pb2 as pb
from scheduler_node.api.kv_handoff_fields import http_kv_fields, kv_fields, source_message, source_params
from scheduler_node.api.openai_protocol import CompletionRequest, KVTransferParams
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.kv.leases import KVSource

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


def test_kv_transfer_params_round_trip_through_json() -> None:
    source = KVSource(("127.0.0.1:5000",), LEASE, (4, 2))
    answer = source_params(source, "cmpl-1-0")
    assert answer["request_id"] == "cmpl-1-0" and answer["lease"] == LEASE.hex()
    pulled = {k: answer[k] for k in ("addresses", "lease", "blocks")}  # what the router sends the decode replica
    body = CompletionRequest.model_validate({"prompt": "hi", "kv_transfer_params": pulled})
    assert http_kv_fields(body.kv_transfer_params, 1, False, True) == {"kv_source": source}
    assert http_kv_fields(KVTransferParams(produce=True), 1, True, False) == {"kv_produce": True}
    assert http_kv_fields(None, 1, True, True) == {}


@pytest.mark.parametrize(
    ("params", "stream", "field"),
    [
        (KVTransferParams(produce=True), True, "kv_transfer_params.produce: a prefill for another replica is not"),
        (
            KVTransferParams(addresses=["a:1"], lease="zz", blocks=[1]),
            False,
            "kv_transfer_params.lease: must be 32 hex",
        ),
        (KVTransferParams(addresses=["a:1"], lease="00ff", blocks=[1]), False, "kv_transfer_params.lease: must be 16"),
        (KVTransferParams(lease=LEASE.hex(), blocks=[1]), False, "kv_transfer_params.addresses"),
    ],
)
def test_bad_kv_transfer_params_are_refused_naming_the_field(
    params: KVTransferParams, stream: bool, field: str
) -> None:
    with pytest.raises(InvalidField, match=field):
        http_kv_fields(params, 1, True, stream)
