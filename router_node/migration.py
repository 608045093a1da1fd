"""Live migration through vllm-router, one mechanism for both doors (issue 31): a request's journey over the
replicas that hand it back.

A replica drained with migrate=true ends each of its migratable requests with the states of its running sequences
(gRPC: responses with `migrated`; OpenAI: a last `migrated` event, api/openai_migration.py). The door that forwards
the request (router/upstream.py for gRPC, router/http_door.py for HTTP) then asks its `Journey`: the replica leaves
the serving set, is never chosen again for this request, and, when the states name leased KV, holds it until the
next target answers (then an Abort of the request there frees it: `answered`) or the journey ends (`close`). When
no other replica takes the request, the last one that handed it back takes it back (`take_back`, once): though
draining, it runs a request it migrated off on from the KV it still holds (api/resume.py `taken_back`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from proto import serving_pb2 as pb
from router_node.replica import NOT_SERVING, Replica, ReplicaPool
from router_node.routing import Route

logger = logging.getLogger(__name__)

Release = Callable[[Replica, str], None]  # frees the KV a replica leases for a request (Forwarder.release)


class Journey:
    """Where one client request went as replicas handed it back; `request_id` is its id on the replicas (the
    Abort that releases a lease names it)."""

    def __init__(self, pool: ReplicaPool, release: Release, request_id: str) -> None:
        self.pool = pool
        self.release = release
        self.request_id = request_id
        self._moved_from: list[tuple[Replica, int]] = []  # each replica it left, and that replica's epoch then
        self.holding: Replica | None = None  # the replica that handed it back, while it keeps its KV for the target
        self.returned = False  # sent back to the replica that handed it back (once)

    def handed_back(
        self, replica: Replica, states: Sequence[pb.SequenceState], draining: bool = True
    ) -> pb.ResumeState:
        """`replica` handed the request back with where each running sequence stopped: what the next target
        continues (`resume`). Not `draining`: a rebalance moved it (router/rebalance.py), the replica serves on."""
        if draining:
            self.pool.set_state(replica, NOT_SERVING, "draining: its requests migrate")
        self._let_go()
        if any(s.HasField("kv_source") for s in states):  # the next target pulls that replica's KV
            self.holding = replica
        self._moved_from.append((replica, replica.epoch))
        logger.info("request %s: migrating %d sequence(s) off %s", self.request_id, len(states), replica.address)
        ordered: list[pb.SequenceState] = sorted(states, key=lambda state: state.index)
        return pb.ResumeState(sequences=ordered)

    @property
    def moved_from(self) -> list[Replica]:
        """The replicas this request left, never chosen again for it while they are the schedulers it left (one
        that drained and came back serving, a rolling restart's, is a target again)."""
        return [replica for replica, epoch in self._moved_from if replica.epoch == epoch]

    def answered(self) -> None:
        """The target answered: it has the KV, the replica that held it may free it."""
        self._let_go()

    def take_back(self) -> Route | None:
        """No replica took the request (the targets died, none is left): the one that handed it back last runs it
        on, once; it frees its KV itself. None when it came from no replica, or went back already."""
        if self.returned or not self._moved_from:
            return None
        self.returned, self.holding = True, None
        last = self._moved_from[-1][0]
        logger.info("request %s: no target took it: back to %s", self.request_id, last.address)
        return Route(last, "take back")

    def close(self) -> None:
        """The request ended (or its client went away): nobody will pull what a replica still holds for it."""
        self._let_go()

    def _let_go(self) -> None:
        if self.holding is not None:
            self.release(self.holding, self.request_id)
            self.holding = None
