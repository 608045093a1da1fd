"""LoRA slots: an adapter keeps its slot while requests the workers hold use it; a request whose adapter finds no
slot waits while others pass; blocks are never shared across adapters."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.lora_slots import LoraRef, LoraSlots, lora_requests
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler

pytestmark = pytest.mark.unit

A, B, C = (LoraRef(n, i, f"/adapters/{n}", f"{n}-v1") for i, n in enumerate("abc", start=1))


def test_pinned_slots_stay_and_the_least_recently_used_idle_one_is_taken() -> None:
    slots = LoraSlots(2)
    assert slots.pin(A).slot == 0 and slots.pin(B).slot == 1
    assert slots.pin(A).slot == 0  # already resident: no reload
    assert not slots.fits(C)  # both pinned
    with pytest.raises(RuntimeError, match="no free slot"):
        slots.pin(C)
    slots.unpin(B)
    assert slots.fits(C) and slots.pin(C).slot == 1  # B's idle slot
    for lora in (A, A, C):
        slots.unpin(lora)
    assert slots.pinned == 0 and slots.resident() == {1: 0, 3: 0}
    assert slots.pin(B).slot == 0  # A was used less recently than C


def test_evicted_adapters_stay_in_the_host_tier_up_to_its_size() -> None:
    a, b, c = (LoraRef(n, i, f"/adapters/{n}", nbytes=100 * i) for i, n in enumerate("abc", start=1))
    slots = LoraSlots(1, host_slots=1)
    assert slots.pin(a).host_slots == 1  # the workers keep the same tier by the same rule
    slots.unpin(a)
    slots.pin(b)  # a evicted: to the host tier
    assert slots.in_host() == [1]
    assert [(m.tier, m.adapters, m.capacity, m.bytes) for m in slots.memory()] == [
        ("device", 1, 1, 200),
        ("host", 1, 1, 100),
    ]
    slots.unpin(b)
    slots.pin(c)  # b evicted; the host tier holds one: a out
    assert slots.in_host() == [2]
    slots.unpin(c)
    slots.pin(b)  # back from the host tier: each adapter is held once
    assert slots.in_host() == [3] and [m.bytes for m in slots.memory()] == [200, 300]
    assert [m.tier for m in LoraSlots(2).memory()] == ["device"]  # no host tier: no host entry


def _request(rid: str, lora: LoraRef | None, prompt: int = 20) -> Request:
    return Request(rid, list(range(10, 10 + prompt)), SamplingOptions(0.0), StopConditions(4, frozenset()),
                   cache_salt=lora.cache_salt if lora else "", lora=lora)  # fmt: skip


def test_a_request_without_a_slot_waits_and_the_others_pass() -> None:
    s = Scheduler(SchedulerConfig(block_size=8, max_num_batched_tokens=256, max_model_len=512, max_loras=1), 64)
    first, second, base = _request("a", A), _request("b", B), _request("base", None)
    for r in (first, second, base):
        s.add(r)
    plan = s.schedule()
    new = {r.handle: r.lora for r in plan.new_requests}
    assert new == {first.handle: plan.new_requests[0].lora, base.handle: None}
    assert plan.new_requests[0].lora is not None and plan.new_requests[0].lora.slot == 0
    assert second.status is Status.WAITING
    assert lora_requests(s.running, s.waiting) == {("a", "running"): 1.0, ("b", "waiting"): 1.0}  # the metrics
    s.finish("a", Status.FINISHED_ABORTED)
    plan = s.schedule()
    assert [(r.handle, r.lora and (r.lora.id, r.lora.slot)) for r in plan.new_requests] == [(second.handle, (2, 0))]
    assert plan.finished == [first.handle]  # the worker drops it before the slot's new adapter is loaded


def test_prefix_blocks_are_not_shared_across_adapters() -> None:
    hashes = {
        name: _request(name, lora, prompt=32).update_block_hashes(8) for name, lora in (("a", A), ("b", B), ("-", None))
    }
    assert len({h[0] for h in hashes.values()}) == 3
    assert _request("a2", A, prompt=32).update_block_hashes(8) == hashes["a"]
