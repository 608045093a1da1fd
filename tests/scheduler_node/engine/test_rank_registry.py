"""The rank registry without sockets: joining, ready, lost, rejoin, heartbeat ages and the world's capacity, driven
message by message with a list for an outbox and a hand-moved clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from proto.wire import Assignment, Heartbeat, Message, Shutdown, WorkerHello, WorkerReady
from scheduler_node.engine.rank_registry import JOINING, LOST, READY, RankRegistry

pytestmark = pytest.mark.unit

TIMEOUT = 2.0  # the heartbeat timeout


class World:
    """A registry whose messages land in `sent` (identity, message) and whose clock is `now`."""

    def __init__(self, world_size: int = 1, tp: int = 1, join_timeout: float = 60.0) -> None:
        self.now = 100.0
        self.sent: list[tuple[bytes, Message]] = []
        self.unreachable: set[bytes] = set()  # sends to these fail, as to a peer whose connection dropped
        self.lost_reasons: list[str] = []
        self.registry = RankRegistry(self._send, TIMEOUT, on_lost=self.lost_reasons.append, clock=lambda: self.now)
        self.registry.name = "127.0.0.1:5555"
        pp = world_size // tp

        def assignment(rank: int) -> Assignment:
            return Assignment(rank, world_size, "/m", "auto", 16, 64, 8, tensor_parallel_size=tp,
                              pipeline_parallel_size=pp)  # fmt: skip

        self.registry.assemble(assignment, join_timeout)

    def _send(self, identity: bytes, message: Message) -> str:
        if identity in self.unreachable:
            return "ZMQError: Host unreachable"
        self.sent.append((identity, message))
        return ""

    def to(self, identity: bytes) -> list[Message]:
        return [m for i, m in self.sent if i == identity]

    def join(self, identity: bytes, blocks: int = 100, host_blocks: int = 8, kv_bytes: int = 0) -> Assignment:
        """Hello, then Ready with this capacity; the Assignment it got."""
        self.registry.hello(identity, WorkerHello("h", 1, "cpu"), "10.0.0.1")
        assignment = self.to(identity)[-1]
        assert isinstance(assignment, Assignment), assignment
        ready = WorkerReady(assignment.rank, blocks, kv_bytes or blocks * 1000, num_host_blocks=host_blocks)
        self.registry.ready(identity, ready)
        return assignment


def test_a_worker_joins_gets_the_lowest_rank_and_is_ready_once_it_reports_its_capacity() -> None:
    w = World(world_size=2)
    r = w.registry
    r.hello(b"a", WorkerHello("h", 7, "cpu"), "10.0.0.1")
    (assignment,) = w.to(b"a")
    assert isinstance(assignment, Assignment) and (assignment.rank, assignment.num_kv_blocks) == (0, 0)
    assert [(x.rank, x.state, x.pid) for x in r.status()] == [(0, JOINING, 7)]
    assert r.free_ranks() == [1] and not r.all_ready and r.changed.is_set()
    r.ready(b"a", WorkerReady(0, 100, 100_000, num_host_blocks=8))
    assert [x.state for x in r.status()] == [READY] and not r.all_ready  # rank 1 is missing
    assert isinstance(w.to(b"a")[-1], Heartbeat), "a ready worker learns the heartbeat timeout at once"
    assert w.to(b"a")[-1] == Heartbeat(0, 0, TIMEOUT)
    assert "ranks [1] did not join 127.0.0.1:5555 within 5 s" in r.not_ready(5)
    w.join(b"b", blocks=80, host_blocks=4)
    assert r.all_ready and [x.rank for x in r.workers] == [0, 1]
    assert (r.capacity.num_kv_blocks, r.capacity.num_swap_blocks) == (80, 4)  # the smallest rank's
    assert r.capacity.world_bytes_per_block == 2000  # one block summed over the ranks


def test_the_capacity_is_unknown_until_the_world_is_complete() -> None:
    w = World()
    with pytest.raises(RuntimeError, match="not assembled"):
        _ = w.registry.capacity


def test_tensor_and_pipeline_places_follow_the_rank() -> None:
    w = World(world_size=4, tp=2)
    for identity in (b"a", b"b", b"c", b"d"):
        w.join(identity)
    assert [(x.rank, x.tp_rank, x.pp_stage) for x in w.registry.workers] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]


def test_strangers_second_hellos_and_wrong_readies_change_nothing() -> None:
    w = World()
    w.join(b"a")
    r = w.registry
    r.hello(b"a", WorkerHello("h", 1, "cpu"), "")  # a second Hello from a known worker: ignored
    assert [type(m) for m in w.to(b"a")] == [Assignment, Heartbeat]
    r.hello(b"late", WorkerHello("h", 2, "cpu"), "")  # every rank is taken
    (refusal,) = w.to(b"late")
    assert isinstance(refusal, Shutdown) and "all 1 ranks of 127.0.0.1:5555 are taken" in refusal.reason
    r.ready(b"nobody", WorkerReady(0, 5, 5))  # not assigned a rank
    r.ready(b"a", WorkerReady(0, 5, 5))  # ready already
    assert r.capacity.num_kv_blocks == 100 and r.all_ready


def test_a_placement_may_turn_a_worker_away_or_choose_its_rank() -> None:
    w = World(world_size=2)
    r = w.registry
    chosen: list[Sequence[int]] = []

    def claim(hello: WorkerHello, address: str, free: Sequence[int]) -> int | None:
        chosen.append(list(free))
        return {"gpu-1": 1, "bogus": 7}.get(hello.host)

    r.claim = claim
    r.hello(b"x", WorkerHello("elsewhere", 1, "cuda"), "10.0.0.9")
    r.hello(b"y", WorkerHello("bogus", 1, "cuda"), "10.0.0.9")  # a rank that is not free: turned away too
    r.hello(b"z", WorkerHello("gpu-1", 1, "cuda"), "10.0.0.2")
    assert isinstance(w.to(b"x")[0], Shutdown) and isinstance(w.to(b"y")[0], Shutdown)
    assignment = w.to(b"z")[0]
    assert isinstance(assignment, Assignment) and assignment.rank == 1
    assert chosen == [[0, 1], [0, 1], [0, 1]]
    assert r.free_ranks() == [0]


def test_a_lost_rank_fails_the_steps_tells_the_worker_and_is_lost_once() -> None:
    w = World()
    w.join(b"a")
    r = w.registry
    r.changed.clear()
    (info,) = r.workers
    r.lose(info, "connection closed")
    assert r.lost.is_set() and not r.all_ready and r.changed.is_set()
    assert r.lost_reason == "rank 0 lost: connection closed" and w.lost_reasons == [r.lost_reason]
    assert w.to(b"a")[-1] == Shutdown("declared lost: connection closed")
    r.lose(info, "again")
    assert w.lost_reasons == ["rank 0 lost: connection closed"], "a rank is lost once"
    assert [x.state for x in r.status()] == [LOST] and r.free_ranks() == [0]
    assert r.get(b"a") is None and r.seen(b"a") is None, "a lost worker is a stranger from now on"


def test_a_replacement_holds_the_worlds_size_and_a_smaller_one_shrinks_it() -> None:
    w = World()
    w.join(b"a", blocks=100, host_blocks=8)
    r = w.registry
    r.lose(r.workers[0], "gone")
    replacement = w.join(b"b", blocks=100)
    assert (replacement.num_kv_blocks, replacement.num_swap_blocks) == (100, 8), "told the world's size"
    assert r.all_ready and not r.lost.is_set() and r.lost_reason == ""
    assert [(x.state, x.identity) for x in r.status()] == [(READY, b"b")]
    r.lose(r.workers[0], "gone")
    w.join(b"c", blocks=60, host_blocks=8)  # it could not hold 100
    assert r.capacity.num_kv_blocks == 60


def test_losing_one_rank_of_several_dismisses_every_rank() -> None:
    """torch.distributed cannot take a new member: ready, loading and waiting ranks all leave."""
    w = World(world_size=3)
    w.join(b"a")
    w.join(b"b")
    w.registry.hello(b"c", WorkerHello("h", 3, "cpu"), "")  # still loading
    w.registry.lose(w.registry.workers[0], "stalled")
    for identity in (b"b", b"c"):
        last = w.to(identity)[-1]
        assert isinstance(last, Shutdown) and "rank 0 was lost; every rank restarts" in last.reason
    assert w.registry.free_ranks() == [0, 1, 2]
    assert w.lost_reasons == ["rank 0 lost: stalled"]


def test_heartbeat_ages_a_silent_rank_is_lost_and_a_heard_one_gets_a_beat() -> None:
    w = World(world_size=2)
    w.join(b"a")
    w.join(b"b")
    r = w.registry
    w.now += TIMEOUT  # exactly the timeout: not past it
    r.tick(w.now)
    assert w.to(b"a")[-1] == Heartbeat(0, 1, TIMEOUT) and w.to(b"b")[-1] == Heartbeat(1, 1, TIMEOUT)
    r.seen(b"b")  # b said something
    assert [w.now - x.last_seen for x in r.workers] == [TIMEOUT, 0.0]  # what ListWorkers reports as ages
    w.now += 0.5
    r.tick(w.now)
    assert w.lost_reasons == ["rank 0 lost: no heartbeat for 2.5 s"]
    assert not r.all_ready


def test_a_worker_that_never_gets_ready_gives_its_rank_back() -> None:
    w = World(join_timeout=30.0)
    r = w.registry
    r.hello(b"slow", WorkerHello("h", 1, "cpu"), "")
    w.now += 30.0
    r.tick(w.now)
    assert r.get(b"slow") is not None, "not past the join timeout yet"
    w.now += 1.0
    r.tick(w.now)
    assert r.get(b"slow") is None and r.free_ranks() == [0]
    last = w.to(b"slow")[-1]
    assert isinstance(last, Shutdown) and "not ready within 30 s" in last.reason
    assert w.lost_reasons == [], "a rank that was never ready is not a lost one"
    w.join(b"next")
    assert r.all_ready


def test_a_probe_finds_whose_connection_dropped() -> None:
    w = World(world_size=2)
    w.join(b"a")
    w.registry.hello(b"b", WorkerHello("h", 2, "cpu"), "")  # joining
    assert not w.registry.probe(), "everyone reachable: nobody is lost"
    w.unreachable.add(b"b")
    assert w.registry.probe()
    assert w.registry.free_ranks() == [0, 1], "a joiner that left frees its rank (and the world disbands)"
    assert w.lost_reasons == []
    w2 = World()
    w2.join(b"a")
    w2.unreachable.add(b"a")
    assert w2.registry.probe()
    assert w2.lost_reasons == ["rank 0 lost: connection closed (ZMQError: Host unreachable)"]


def test_lose_ready_loses_only_ready_owers_and_shutdown_reaches_everyone() -> None:
    w = World(world_size=2)
    w.join(b"a")
    w.registry.hello(b"b", WorkerHello("h", 2, "cpu"), "")
    w.registry.lose_ready([b"b", b"nobody"], "step 3 ran past its deadline")
    assert w.lost_reasons == [] and w.registry.workers[0].state == READY
    w.registry.shutdown_all("scheduler stopped")
    assert all(w.to(i)[-1] == Shutdown("scheduler stopped") for i in (b"a", b"b"))
    w.registry.lose_ready([b"a"], "step 3 ran past its deadline")
    assert w.lost_reasons == ["rank 0 lost: step 3 ran past its deadline"]


def outbox(sent: list[tuple[bytes, Message]]) -> Callable[[bytes, Message], str]:
    def send(identity: bytes, message: Message) -> str:
        sent.append((identity, message))
        return ""

    return send


def test_hellos_before_the_world_is_known_wait_for_it_and_are_answered_in_order() -> None:
    sent: list[tuple[bytes, Message]] = []
    registry = RankRegistry(outbox(sent), TIMEOUT)
    registry.hello(b"a", WorkerHello("h", 1, "cpu", "/m", 1, 2), "10.0.0.1")
    registry.hello(b"b", WorkerHello("h", 2, "cpu", "/m", 1, 2), "10.0.0.2")
    registry.hello(b"a", WorkerHello("h", 1, "cpu", "/m", 1, 2), "10.0.0.1")  # a second Hello: dropped
    assert registry.hello_parked.is_set() and [p[1].pid for p in registry.parked] == [1, 2] and not sent

    def assignment(rank: int) -> Assignment:
        return Assignment(rank, 2, "/m", "auto", 16, 64, 8, tensor_parallel_size=1, pipeline_parallel_size=2)

    registry.assemble(assignment, 60.0)
    assert [(i, m.rank) for i, m in sent if isinstance(m, Assignment)] == [(b"a", 0), (b"b", 1)]
    assert registry.parked == []


def test_a_worker_the_world_refuses_is_told_why_and_gets_no_rank() -> None:
    w = World(world_size=1)
    w.registry.vet = lambda hello: "this worker disagrees with the world: --model /x" if hello.model == "/x" else ""
    w.registry.hello(b"x", WorkerHello("h", 9, "cpu", "/x", 1, 1), "10.0.0.9")
    (refusal,) = w.to(b"x")
    assert refusal == Shutdown("this worker disagrees with the world: --model /x", refused=True)
    assert w.registry.free_ranks() == [0]
    w.join(b"a")  # one that agrees takes the rank


def test_waiting_workers_are_told_when_the_world_cannot_be_built_or_the_scheduler_stops() -> None:
    sent: list[tuple[bytes, Message]] = []
    registry = RankRegistry(outbox(sent), TIMEOUT)
    registry.hello(b"a", WorkerHello("h", 1, "cpu", "/m"), "10.0.0.1")
    registry.shutdown_all("stopping")
    registry.refuse_parked("the scheduler cannot serve this world: no such model")
    assert sent == [
        (b"a", Shutdown("stopping")),
        (b"a", Shutdown("the scheduler cannot serve this world: no such model", refused=True)),
    ]
    assert registry.parked == []
