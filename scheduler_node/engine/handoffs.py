"""What leaves this replica for another one: running requests moved off by a drain with migration (each ends with
its state, finish_reason MIGRATED: scheduler_node/core/migration.py) and finished prefills' KV held under a lease
until a decode replica pulls it (scheduler_node/core/kv_handoff.py). A part of EngineCore (engine/core.py)."""

from __future__ import annotations

import asyncio
import logging

from proto.transport import WorkerTransport
from scheduler_node.core.kv_handoff import KVSource
from scheduler_node.core.request import Status
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.output_side import OutputSide

logger = logging.getLogger(__name__)


class Handoffs:
    scheduler: Scheduler
    workers: WorkerTransport
    outputs: OutputSide
    _wake: asyncio.Event
    _lease_timer: asyncio.TimerHandle | None

    def migrate(self) -> int:
        """Move every live migratable request off this replica, between steps: each sequence ends with its state
        (finish_reason MIGRATED) and its blocks are freed at once, since the target recomputes them from its
        tokens (a KV import would free them once the target confirms). Tokens of plans in flight are dropped, as
        an abort's are: the state holds exactly the tokens its client got. Returns how many requests moved."""
        moved = 0
        for request_id in list(self.outputs.migratable):
            for req_id in list(self.outputs.requests.get(request_id, ())):
                req = self.scheduler.finish(req_id, Status.FINISHED_MIGRATED)
                if req is not None:
                    self.outputs.migrate(req)
            moved += 1
        if moved:
            logger.info("migrating %d request(s) off this replica", moved)
        self._wake.set()  # tell the workers to forget them
        return moved

    def kv_source(self, request_id: str) -> KVSource | None:
        """Where another replica pulls a finished prefill's prompt KV from; None when no lease is held for it."""
        lease = self.scheduler.leases.held.get(request_id)
        addresses = self.workers.capacity.kv_addresses
        return lease.source(list(addresses)) if lease is not None and addresses else None

    def release_kv(self, request_id: str) -> bool:
        """Free a finished prefill's leased blocks (pulled, or nobody will); False if none are held."""
        if not self.scheduler.release_kv(request_id):
            return False
        self._wake.set()  # the workers forget the lease with the next plan
        return True

    def _arm_lease_timer(self) -> None:
        """Wake when the earliest lease held expires (no step may come to notice it)."""
        leases = self.scheduler.leases.held
        if not leases:
            return
        loop = asyncio.get_running_loop()
        at = loop.time() + max(0.0, min(lease.expires for lease in leases.values()) - self.scheduler.clock())
        if self._lease_timer is not None:
            if self._lease_timer.when() <= at:
                return
            self._lease_timer.cancel()
        self._lease_timer = loop.call_at(at, self._expire_leases)

    def _expire_leases(self) -> None:
        self._lease_timer = None
        if self.scheduler.expire_leases():
            self._wake.set()
        self._arm_lease_timer()
