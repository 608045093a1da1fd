"""The rank registry: which worker holds which rank of the world, and in what state — no socket in sight.

A worker says Hello and gets a free rank (JOINING); it reports its KV capacity and is READY; it is LOST when its
connection drops, it stays silent past the heartbeat timeout, or a step of it overran its deadline. A lost rank is
free for a replacement to claim. With more than one rank, losing one dismisses them all: a torch.distributed
world cannot take a new member. Everything the registry tells a worker goes through `send` (the transport's
socket in scheduler_node/engine/worker_link.py; a list in the unit tests), and its clock is injectable, so every
transition can be driven and checked without a process.

The world's KV size is fixed once every rank of the first world is ready (the smallest rank's); a replacement is
told to allocate exactly that many blocks, so it fits the scheduler's table. One that truly cannot shrinks the
world's capacity instead of being turned away; the engine then shrinks the scheduler to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from proto.drop_log import DropLog
from proto.transport import WorldCapacity
from proto.wire import (
    WORKER_JOIN_TIMEOUT_S,
    Assignment,
    Heartbeat,
    Message,
    Shutdown,
    WorkerHello,
    WorkerReady,
)

logger = logging.getLogger(__name__)

JOINING, READY, LOST = "joining", "ready", "lost"

# (identity, message) -> why it could not be sent ("" when sent)
Send = Callable[[bytes, Message], str]
# Which free rank a joining worker gets: (hello, its address, the free ranks) -> one of them, or None to turn it away
Claim = Callable[[WorkerHello, str, Sequence[int]], int | None]
# Why a worker cannot join this world (its model or the world's shape disagree: scheduler_node/cli/adopt.py), or ""
Vet = Callable[[WorkerHello], str]


@dataclass(slots=True)
class WorkerInfo:
    rank: int
    identity: bytes
    host: str
    pid: int
    device: str
    num_kv_blocks: int = 0
    num_host_blocks: int = 0
    swap_bytes_per_s: float = 0.0
    kv_cache_bytes: int = 0
    kv_format: str = ""
    tiers: WorkerReady | None = None  # its Ready: the world's capacity is computed from every rank's
    tp_rank: int = 0
    pp_stage: int = 0
    state: str = JOINING  # joining | ready | lost
    last_seen: float = field(default_factory=time.monotonic)


def lowest_free(hello: WorkerHello, address: str, free: Sequence[int]) -> int | None:
    return free[0]


def anyone(hello: WorkerHello) -> str:
    return ""


class RankRegistry:
    """The ranks of one world and the workers that hold them (see the module's docstring)."""

    def __init__(
        self,
        send: Send,
        heartbeat_timeout: float,
        on_lost: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
        drops: DropLog | None = None,
    ) -> None:
        self._send_to = send
        # Hellos and Readies it ignores: anyone who reaches the worker port may send them (without CURVE), so they
        # are counted and logged at a bounded rate, with the transport's malformed messages (proto/drop_log.py).
        self.drops = drops if drops is not None else DropLog("workers", logger)
        self.heartbeat_timeout = heartbeat_timeout
        self._on_lost = on_lost  # the transport fails the steps in flight
        self._clock = clock
        self.name = ""  # the world's address, for messages
        self.world_size = 0
        self.ranks: list[WorkerInfo | None] = []
        self._by_identity: dict[bytes, WorkerInfo] = {}  # joining and ready workers
        self._assignment: Callable[[int], Assignment] | None = None
        self.claim: Claim = lowest_free  # a placement can match hosts and devices instead
        self.vet: Vet = anyone  # a world that knows its model and shape refuses a worker that says otherwise
        # Hellos before the world is known (a scheduler without --model waits for the first): answered at `assemble`
        self.parked: list[tuple[bytes, WorkerHello, str]] = []
        self.hello_parked = asyncio.Event()
        self._capacity: WorldCapacity | None = None  # fixed once the first world is ready
        self.all_ready_event = asyncio.Event()
        self.lost = asyncio.Event()  # set while a rank is lost, until every rank is ready again
        self.lost_reason = ""
        self.changed = asyncio.Event()  # set on every change of a rank's state; health reporting clears it
        self.beats = 0
        self.join_timeout = WORKER_JOIN_TIMEOUT_S

    # ---- reading

    @property
    def workers(self) -> list[WorkerInfo]:
        """The ready ranks, by rank."""
        return [w for w in self.ranks if w is not None and w.state == READY]

    @property
    def all_ready(self) -> bool:
        return self.all_ready_event.is_set()

    @property
    def capacity(self) -> WorldCapacity:
        if self._capacity is None:
            raise RuntimeError("the world has not assembled yet")
        return self._capacity

    def status(self) -> list[WorkerInfo]:
        """Every rank's latest worker (ready or lost) and every worker still joining, by rank."""
        known = [w for w in self.ranks if w is not None]
        joining = [w for w in self._by_identity.values() if w.state == JOINING]
        return sorted(known + joining, key=lambda w: (w.rank, w.state != READY))

    def get(self, identity: bytes) -> WorkerInfo | None:
        """The joining or ready worker behind `identity`."""
        return self._by_identity.get(identity)

    def seen(self, identity: bytes) -> WorkerInfo | None:
        """A message came from `identity`: its worker (if known) is alive as of now."""
        info = self._by_identity.get(identity)
        if info is not None:
            info.last_seen = self._clock()
        return info

    def not_ready(self, timeout: float) -> str:
        """Why the world is not complete, after `timeout` seconds of waiting."""
        joining = sorted(w.rank for w in self._by_identity.values() if w.state == JOINING)
        missing = [r for r, w in enumerate(self.ranks) if (w is None or w.state != READY) and r not in joining]
        text = f"workers for ranks {missing} did not join {self.name} within {timeout:.0f} s"
        if joining:  # they got their rank but never reported ready: loading, or at the rendezvous
            text += f"; ranks {joining} joined but were not ready (loading, or waiting for the others)"
        return text

    # ---- joining

    def assemble(self, assignment: Callable[[int], Assignment], join_timeout: float) -> None:
        """Open the world's ranks; each joining worker gets `assignment(rank)`."""
        self.world_size = assignment(0).world_size
        self.ranks = [None] * self.world_size
        self._assignment = assignment
        self.join_timeout = join_timeout
        parked, self.parked = self.parked, []
        for identity, msg, address in parked:
            self.hello(identity, msg, address)

    def refuse_parked(self, reason: str) -> None:
        """The world cannot be built (the first worker's model does not load here): every waiting worker is told."""
        for identity, _, _ in self.parked:
            self.tell(identity, Shutdown(reason, refused=True))
        self.parked = []

    def hello(self, identity: bytes, msg: WorkerHello, address: str) -> None:
        if identity in self._by_identity or any(identity == p[0] for p in self.parked):
            self.drops.drop("a second Hello from pid %d", msg.pid)
            return
        if self._assignment is None:  # the world is not known yet: the scheduler reads it off the first Hello
            self.parked.append((identity, msg, address))
            self.hello_parked.set()
            return
        why = self.vet(msg)
        if why:
            logger.error("refusing pid %d on %s: %s", msg.pid, msg.host, why)
            self.tell(identity, Shutdown(why, refused=True))
            return
        free = self.free_ranks()
        rank = self.claim(msg, address, free) if free else None
        if rank is None or rank not in free or self._assignment is None:
            self.drops.drop("turning away pid %d on %s: every rank is taken", msg.pid, msg.host)
            self.tell(identity, Shutdown(f"all {self.world_size} ranks of {self.name} are taken"))
            return
        a = self._assignment(rank)
        if self._capacity is not None:  # a replacement: it holds exactly what the world holds
            a = msgspec.structs.replace(
                a,
                num_kv_blocks=self._capacity.num_kv_blocks,
                num_swap_blocks=self._capacity.num_swap_blocks,
                num_compact_blocks=self._capacity.num_compact_blocks,
            )
        tp = max(1, a.tensor_parallel_size)
        info = WorkerInfo(rank, identity, msg.host, msg.pid, msg.device, tp_rank=rank % tp, pp_stage=rank // tp)
        info.last_seen = self._clock()
        self._by_identity[identity] = info
        logger.info("worker rank %d: pid %d on %s (%s)", rank, msg.pid, msg.host, msg.device)
        self.tell(identity, a)
        self.changed.set()

    def ready(self, identity: bytes, msg: WorkerReady) -> None:
        info = self._by_identity.get(identity)
        if info is None or info.state != JOINING or msg.rank != info.rank:
            self.drops.drop("Ready (rank %d) from a worker that was not assigned it", msg.rank)
            return
        info.num_kv_blocks = msg.num_kv_blocks
        info.num_host_blocks = msg.num_host_blocks
        info.swap_bytes_per_s = msg.swap_bytes_per_s
        info.kv_cache_bytes = msg.kv_cache_bytes
        info.kv_format = msg.kv_format
        info.tiers = msg
        info.state = READY
        info.last_seen = self._clock()
        self.ranks[info.rank] = info
        logger.info("rank %d ready: pid %d, %d KV blocks", info.rank, info.pid, info.num_kv_blocks)
        # At once, not at the next beat: until its first heartbeat a worker gives a silent scheduler its long
        # connect timeout, so a scheduler that died in between would leave it waiting minutes to exit.
        self.tell(identity, self._beat(info))
        self._update_state()

    def free_ranks(self) -> list[int]:
        taken = {w.rank for w in self._by_identity.values()}
        return [r for r, w in enumerate(self.ranks) if (w is None or w.state == LOST) and r not in taken]

    def _update_state(self) -> None:
        if self.world_size and len(self.workers) == self.world_size:
            self._settle_capacity()
            self.all_ready_event.set()
            self.lost.clear()
            self.lost_reason = ""
        else:
            self.all_ready_event.clear()
        self.changed.set()

    def _settle_capacity(self) -> None:
        """The world is complete: fix its capacity (first time), or shrink it to a replacement that holds less."""
        new = WorldCapacity.of([w.tiers for w in self.workers if w.tiers is not None])
        old = self._capacity
        if old is not None and (new.num_kv_blocks, new.num_swap_blocks) != (old.num_kv_blocks, old.num_swap_blocks):
            logger.warning(
                "a replacement could not hold the world's KV size: %d KV blocks and %d swap blocks from now on "
                "(were %d and %d)",
                new.num_kv_blocks,
                new.num_swap_blocks,
                old.num_kv_blocks,
                old.num_swap_blocks,
            )
        if old is None or new != old:
            self._capacity = new

    # ---- losing

    def lose(self, info: WorkerInfo, reason: str) -> None:
        """`info`'s rank is lost (once): it is told to leave, the others too with several ranks, and the steps
        in flight fail (`on_lost`)."""
        if info.state == LOST:
            return
        logger.error("rank %d (pid %d on %s) lost: %s", info.rank, info.pid, info.host, reason)
        self._dismiss(info, reason)
        self._disband(f"rank {info.rank} was lost")
        self.lost_reason = f"rank {info.rank} lost: {reason}"
        self.lost.set()
        self._on_lost(self.lost_reason)
        self._update_state()

    def lose_ready(self, identities: Iterable[bytes], reason: str) -> None:
        """Lose those of these workers that are ready (a step they owe overran its deadline)."""
        for identity in list(identities):
            info = self._by_identity.get(identity)
            if info is not None and info.state == READY:
                self.lose(info, reason)

    def _dismiss(self, info: WorkerInfo, why: str) -> None:
        info.state = LOST
        self._by_identity.pop(info.identity, None)
        self.tell(info.identity, Shutdown(f"declared lost: {why}"))  # reaches a stalled worker when it wakes

    def _disband(self, why: str) -> None:
        """A torch.distributed world cannot take a new member: when one rank of a world of several is gone, every
        other rank — ready, loading or at the rendezvous — leaves too, and the supervisor starts them all again
        (a replacement alone would wait at a rendezvous the others already passed)."""
        if self.world_size > 1:
            for w in list(self._by_identity.values()):
                self._dismiss(w, f"{why}; every rank restarts")

    # ---- liveness

    def tick(self, now: float) -> None:
        """One heartbeat round: a ready rank silent past the heartbeat timeout is lost, the others get a beat;
        a worker still joining after `join_timeout` gives its rank back."""
        self.beats += 1
        for w in self.workers:
            if now - w.last_seen > self.heartbeat_timeout:
                self.lose(w, f"no heartbeat for {now - w.last_seen:.1f} s")
            else:
                self.tell(w.identity, self._beat(w))
        for w in list(self._by_identity.values()):
            if w.state == JOINING and now - w.last_seen > self.join_timeout:
                logger.error(
                    "rank %d: pid %d did not get ready in %.0f s; freeing the rank", w.rank, w.pid, now - w.last_seen
                )
                del self._by_identity[w.identity]
                self.tell(w.identity, Shutdown(f"not ready within {self.join_timeout:g} s"))
                self._disband(f"rank {w.rank} was not ready in time")
                self.changed.set()

    def probe(self) -> bool:
        """A connection dropped: find out whose by sending each worker a beat (a gone peer cannot be routed to).
        True when one was gone."""
        found = False
        for w in list(self._by_identity.values()):
            error = self._send_to(w.identity, self._beat(w))
            if not error:
                continue
            found = True
            if w.state == READY:
                self.lose(w, f"connection closed ({error})")
            else:  # it died while loading: its rank is free again
                logger.error("worker pid %d left while joining as rank %d", w.pid, w.rank)
                del self._by_identity[w.identity]
                self._disband(f"rank {w.rank} left while joining")
                self._update_state()
        return found

    def shutdown_all(self, reason: str) -> None:
        """Tell every joining, ready or waiting worker to leave (the scheduler stops)."""
        for w in list(self._by_identity.values()):
            self.tell(w.identity, Shutdown(reason))
        for identity, _, _ in self.parked:
            self.tell(identity, Shutdown(reason))

    def _beat(self, w: WorkerInfo) -> Heartbeat:
        return Heartbeat(w.rank, self.beats, self.heartbeat_timeout)

    def tell(self, identity: bytes, message: Message) -> None:
        """Send `message`; a failure is only logged (a gone worker is found by the probe or the heartbeats)."""
        error = self._send_to(identity, message)
        if error:
            logger.debug("could not send %s: %s", type(message).__name__, error)
