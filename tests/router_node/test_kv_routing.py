"""KV-aware routing without processes: the KV events wire, the router's index and its resync rules (a late start,
a lost batch, a restarted replica), the `kv` strategy's cost (cached prefix against load, least loaded when nothing
is cached, a resynchronizing replica holds nothing), its hashes equal to the scheduler's for token ids, text and
chat messages, and a replica's real publisher feeding the real subscriber over loopback ZeroMQ."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from proto import serving_pb2 as pb
from proto.kv_events import (
    DEVICE,
    RAM,
    REMOVED,
    STORED,
    KVEventBatch,
    KVSnapshot,
    decode_batch,
    decode_snapshot,
    encode_batch,
    encode_snapshot,
)
from proto.wire import SamplingOptions
from router_node.kv_index import KVIndex, ReplicaFeed
from router_node.kv_load import ActiveLoad
from router_node.kv_strategy import PENDING_S, KVAware, PromptTokens, block_hashes
from router_node.metrics import RouterMetrics
from router_node.replica import SERVING, ReplicaPool
from router_node.request import RouteRequest
from router_node.routing import Router
from router_node.upstream import Forwarder
from scheduler_node.core.request import Request, StopConditions
from settings.router import parse_replica
from tests.support.stand_in import tokenizer

pytestmark = pytest.mark.unit

BS = 4
EPOCH, OTHER = b"e" * 8, b"f" * 8


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def batch(seq: int, *events: tuple[int, int, bytes | None, bytes | None], epoch: bytes = EPOCH) -> KVEventBatch:
    return decode_batch(encode_batch(epoch, seq, BS, list(events)))


def stored(i: int, tier: int = DEVICE) -> tuple[int, int, bytes | None, bytes | None]:
    return (STORED, tier, h(i), None)


def snapshot(seq: int, *held: int, epoch: bytes = EPOCH) -> KVSnapshot:
    return decode_snapshot(encode_snapshot(epoch, seq, BS, [(DEVICE, h(i)) for i in held]))


# ---- the index and its resync rules


def test_overlap_counts_leading_blocks_in_any_tier() -> None:
    index = KVIndex()
    for i in (0, 1, 3):
        index.store("a", DEVICE, h(i))
    index.store("b", RAM, h(0))
    assert index.overlap([h(0), h(1), h(2), h(3)], ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}
    index.remove("a", DEVICE, h(0))
    assert index.overlap([h(0), h(1)], ["a", "b"]) == {"a": 0, "b": 1}
    index.clear("b", RAM)
    assert index.holders.keys() == {h(1), h(3)} and index.num_blocks("b") == 0


def test_a_late_subscriber_buffers_until_its_snapshot_and_replays_what_came_after() -> None:
    index = KVIndex()
    feed = ReplicaFeed("a", index)
    feed.on_batch(batch(5, stored(1)))  # already in the snapshot below
    feed.on_batch(batch(6, stored(2), (REMOVED, DEVICE, h(0), None)))
    assert not feed.synced and index.num_blocks("a") == 0, "nothing counts before the snapshot"
    feed.on_snapshot(snapshot(5, 0, 1))
    assert feed.synced and feed.seq == 6 and index.owned["a"] == {h(1), h(2)}


def test_a_hole_in_the_sequence_drops_the_replica_until_a_snapshot() -> None:
    index = KVIndex()
    feed = ReplicaFeed("a", index)
    feed.on_snapshot(snapshot(0))
    feed.on_batch(batch(1, stored(1)))
    feed.on_batch(batch(3, stored(3)))  # batch 2 was lost
    assert not feed.synced and index.num_blocks("a") == 0 and feed.resyncs == 1
    feed.on_batch(batch(4, stored(4)))
    feed.on_snapshot(snapshot(3, 1, 2, 3))
    assert feed.synced and index.owned["a"] == {h(1), h(2), h(3), h(4)}


def test_a_new_epoch_is_a_restarted_replica_whose_old_blocks_are_gone() -> None:
    index = KVIndex()
    feed = ReplicaFeed("a", index)
    feed.on_snapshot(snapshot(7, 1, 2, 3))
    feed.on_batch(batch(1, epoch=OTHER))  # the restarted replica's first heartbeat: seq 1 of a new epoch
    assert not feed.synced and index.num_blocks("a") == 0
    feed.on_snapshot(snapshot(1, epoch=OTHER))
    assert feed.synced and feed.epoch == OTHER and index.num_blocks("a") == 0


def test_a_snapshot_followed_by_another_epoch_asks_again() -> None:
    feed = ReplicaFeed("a", KVIndex())
    feed.on_batch(batch(9, stored(1), epoch=OTHER))  # arrived after the request: the replica restarted meanwhile
    feed.on_snapshot(snapshot(8, 1))
    assert not feed.synced and feed.index.num_blocks("a") == 0
    assert [b.epoch for b in feed.buffered] == [OTHER], "kept for the next snapshot (of the new epoch)"


# ---- the strategy


def kv_pool(n: int = 2) -> tuple[ReplicaPool, KVIndex, dict[str, ReplicaFeed], KVAware]:
    pool = ReplicaPool(parse_replica(f"h:{i + 1},model=m,kv_events=h:{100 + i}") for i in range(n))
    for r in pool.replicas:
        pool.set_state(r, SERVING)
    index = KVIndex()
    feeds = {r.address: ReplicaFeed(r.address, index) for r in pool.replicas}
    for feed in feeds.values():
        feed.on_snapshot(snapshot(0))
    return pool, index, feeds, KVAware(index, feeds, PromptTokens({"m": tokenizer()}), clock=lambda: NOW[0])


NOW = [0.0]  # the strategies' clock: a test moves it past PENDING_S to let routed-but-unconfirmed blocks go


def hold(feed: ReplicaFeed, ids: list[int], salt: str = "") -> None:
    hashes = block_hashes(ids, BS, salt)
    feed.on_batch(batch(feed.seq + 1, *[(STORED, DEVICE, x, None) for x in hashes]))


def test_kv_routes_to_the_cached_prefix_until_the_load_outweighs_it() -> None:
    """The load is the work sent to a replica and not done, in blocks: cheap hits ahead on the replica holding the
    prefix cost it little (a queue-length cost counted each as a whole prompt and sent the request away); long
    prompts it must compute first do outweigh the cache, until they are computed or end."""
    pool, _, feeds, kv = kv_pool()
    a, b = pool.replicas
    prompt = list(range(100, 180))  # 20 blocks
    hold(feeds[b.address], prompt[:76])  # b holds 19 of them
    request = RouteRequest("m", prompt_token_ids=prompt + [1, 2], max_tokens=4)
    assert kv.overlap_weight == 4
    hits = [kv.choose(request, [a, b]) for _ in range(5)]
    assert [(p.replica, p.decision) for p in hits] == [(b, "overlap")] * 5
    b.in_flight = 5  # their streams are open there
    # The first computes 2 blocks, the next 1 each (the first's are predicted on b); they share 20 blocks, 2 own.
    assert kv.active.prefill_blocks(b.address) == 6 and kv.active.active_blocks(b.address) == 20 + 5 * 2
    assert kv.choose(request, [a, b]).replica is b, "4 x 1 + (6 + 20 + 10 + 2) < 4 x 21 + 20 + 2: cheap hits ahead"
    misses = [kv.choose(RouteRequest("m", prompt_token_ids=list(range(500 + 90 * i, 590 + 90 * i)), max_tokens=4),
                        [b]) for i in range(2)]  # fmt: skip
    pick = kv.choose(request, [a, b])  # two whole prompts (23 blocks each) to compute ahead of it on b
    assert (pick.replica, pick.decision) == (a, "load")
    NOW[0] += PENDING_S + 1  # the copy of the prompt predicted on a is forgotten (no event confirmed it)
    for miss in misses:
        assert miss.ticket is not None
        miss.ticket.end()  # their streams closed
    assert kv.choose(request, [a, b]).replica is b
    assert kv.choose(RouteRequest("m", prompt_token_ids=prompt, cache_salt="tenant"), [a, b]).decision == "least"
    NOW[0] += PENDING_S + 1  # what was routed to a (its blocks were never confirmed by events) is forgotten
    feeds[b.address].distrust()  # resynchronizing: holds nothing
    assert kv.choose(request, [a, b]).decision == "least"


def test_a_routed_request_counts_on_its_replica_until_its_stream_closes() -> None:
    """Its prompt blocks to compute count until its first token (prefilled), the blocks it holds until it ends
    (a prefix shared by several requests counts once); ending twice changes nothing."""
    load = ActiveLoad()
    first = load.add("r", [h(1), h(2), h(3)], prefill=3, private=2)
    second = load.add("r", [h(1), h(2), h(4)], prefill=1, private=2)
    assert load.prefill_blocks("r") == 4 and load.active_blocks("r") == 4 + 4
    assert load.active_blocks("r", [h(1), h(5)]) == 9, "a new request's blocks count where they are not held yet"
    first.prefilled()
    first.prefilled()
    assert load.prefill_blocks("r") == 1 and load.active_blocks("r") == 8
    first.end()
    first.end()
    assert load.prefill_blocks("r") == 1 and load.active_blocks("r") == 3 + 2
    second.end()
    assert load.prefill_blocks("r") == 0 and load.active_blocks("r") == 0 and load.active_blocks("other") == 0


def test_the_forwarder_ends_a_routed_requests_load_when_its_stream_closes() -> None:
    """Through the router's forwarding: the prompt's blocks to compute go at the first token, every block at the
    stream's end, whether it ended well or the client went away."""
    pool, _, feeds, kv = kv_pool()
    a, b = pool.replicas
    prompt = list(range(300, 340))
    hold(feeds[b.address], prompt[:20])
    events: dict[str, asyncio.Event] = {}  # one per scenario (an Event belongs to its loop)

    class Call:  # a replica's Generate stream: a first token, then the rest once the test says so
        def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
            return self.responses()

        async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
            yield pb.GenerateResponse(token_ids=[7])
            await events["release"].wait()
            yield pb.GenerateResponse(token_ids=[8])

        def cancel(self) -> None:
            pass

    link: Any = SimpleNamespace(generation=SimpleNamespace(Generate=lambda request, timeout, metadata: Call()))
    forwarder = Forwarder(Router(pool, "kv", kv=kv), {r.address: link for r in pool.replicas}, RouterMetrics())
    route_request = RouteRequest("m", prompt_token_ids=prompt + [1], max_tokens=2)

    async def scenario(stop_early: bool) -> None:
        events["release"] = release = asyncio.Event()
        first = asyncio.Event()
        tokens: list[int] = []

        async def client() -> None:
            async for response in forwarder.generate(pb.GenerateRequest(request_id="r"), route_request, None):
                tokens.extend(response.token_ids)
                first.set()

        task = asyncio.ensure_future(client())
        await asyncio.wait_for(first.wait(), 10)
        assert kv.active.prefill_blocks(b.address) == 0 and kv.active.active_blocks(b.address) > 0
        if stop_early:
            task.cancel()  # the client went away (its call is cancelled)
        else:
            release.set()
        await asyncio.gather(task, return_exceptions=True)
        assert tokens == ([7] if stop_early else [7, 8])
        assert kv.active.active_blocks(b.address) == 0 and b.in_flight == 0

    asyncio.run(scenario(stop_early=False))
    asyncio.run(scenario(stop_early=True))


def test_a_prefix_follows_the_request_routed_before_it_until_its_replica_restarts() -> None:
    """The second request of a prefix, sent while the first still computes it (no events yet), goes where the
    first went; once that replica restarted (a new epoch), what was sent to it counts for nothing."""
    pool, _, feeds, kv = kv_pool()
    prompt = list(range(200, 240))
    first = kv.choose(RouteRequest("m", prompt_token_ids=prompt + [1], max_tokens=4), pool.replicas)
    assert first.decision == "least"
    second = kv.choose(RouteRequest("m", prompt_token_ids=prompt + [2], max_tokens=4), pool.replicas)
    assert (second.replica, second.decision) == (first.replica, "overlap")
    feed = feeds[first.replica.address]
    feed.on_batch(batch(1, epoch=OTHER))  # restarted
    feed.on_snapshot(snapshot(1, epoch=OTHER))
    assert kv.choose(RouteRequest("m", prompt_token_ids=prompt + [3]), pool.replicas).decision == "least"


def test_kv_hashes_text_and_chat_like_the_scheduler() -> None:
    """The router's hashes of a text prompt and of chat messages are the ones the scheduler registers for the
    ids its door makes of them (tokenizer with special tokens; the chat template)."""
    pool, _, feeds, kv = kv_pool()
    a, b = pool.replicas
    tok = tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 4
    chat = [("system", "You are terse."), ("user", text)]
    for request, ids in (
        (RouteRequest("m", prompt=text, cache_salt="s"), tok.encode(text)),
        (RouteRequest("m", messages=chat, cache_salt="s"), tok.apply_chat_template([dict(role=r, content=c)
                                                                                   for r, c in chat])),
    ):  # fmt: skip
        scheduled = Request("x", ids, SamplingOptions(0.0), StopConditions(1, frozenset()), cache_salt="s")
        assert block_hashes(ids, BS, "s") == scheduled.update_block_hashes(BS)
        feeds[b.address].distrust()
        feeds[b.address].on_snapshot(snapshot(0))
        hold(feeds[b.address], ids, "s")
        assert kv.choose(request, [a, b]).replica is b, request
    no_tokenizer = KVAware(kv.index, feeds, PromptTokens({}))
    assert no_tokenizer.choose(RouteRequest("m", prompt=text), [a, b]).decision == "untokenized"


def test_vllm_serve_wires_each_data_parallel_replica_to_a_kv_router() -> None:
    from scheduler_node.cli.serve import build_parser, replica_argv, replica_plans, router_argv

    args = build_parser().parse_args(["--data-parallel-size", "2", "--routing-strategy", "kv", "--device", "cpu"])
    plans = replica_plans(args)
    events = {(p.kv_events_port, p.kv_snapshot_port) for p in plans}
    assert len(events) == 2 and all(port and snap for port, snap in events), "each replica its own ports"
    for plan in plans:
        argv = replica_argv(args, plan, len(plans))
        assert argv[argv.index("--kv-events-port") + 1] == str(plan.kv_events_port)
    router = router_argv(args, plans)
    specs = [parse_replica(v) for k, v in zip(router, router[1:]) if k == "--replica"]
    assert [s.kv_events for s in specs] == [f"127.0.0.1:{p.kv_events_port}" for p in plans]
    assert all(s.tokenizer and s.kv_snapshot for s in specs)
