"""What leaves this replica for another one: running requests moved off by a drain with migration (each ends with
its state, finish_reason MIGRATED: scheduler_node/core/migration.py; their KV leased to the target) and finished
prefills' KV held under a lease until a decode replica pulls it (scheduler_node/core/kv/leases.py). The engine
core (engine/core.py) owns it; the intake and the failures hand sequences back to it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

from proto.transport import WorkerTransport
from proto.wire import StepPlan
from scheduler_node.core.kv.leases import KVSource
from scheduler_node.core.request import Request
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.output_side import OutputSide

logger = logging.getLogger(__name__)


class Handoffs:
    def __init__(
        self,
        scheduler: Scheduler,
        workers: WorkerTransport,
        outputs: OutputSide,
        wake: asyncio.Event,  # the engine core's: the workers must be told (forget, grant, revoke)
    ) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.outputs = outputs
        self._wake = wake
        self._granting: dict[bytes, tuple[Request, KVSource]] = {}  # migrated sequences whose lease is not granted
        self._migrated_off: set[str] = set()  # requests handed back (a drain runs once: bounded by what ran then)
        self._lease_timer: asyncio.TimerHandle | None = None  # frees KV leases nobody pulled
        self._leases_released = asyncio.Event()  # a lease was released: `migrations_settled` looks again
        self._released_seen = scheduler.leases.released

    def migrate(self, request_ids: Collection[str] | None = None) -> int:
        """Move every live migratable request off this replica (those of `request_ids` only: a rebalance, which
        takes none back), between steps: each sequence ends with its state
        (finish_reason MIGRATED). When the workers serve KV, the blocks it computed stay leased to its target
        (the state names them: the target pulls instead of recomputing) and its last delta waits until the plan
        granting the lease has run (`_granted`); else its blocks are freed at once. Tokens of plans in flight are
        dropped, as an abort's are: the state holds exactly the tokens its client got. Returns how many requests
        moved."""
        addresses = list(self.workers.capacity.kv_addresses)
        serve = bool(addresses) and all(addresses)
        moved = 0
        chosen = [r for r in self.outputs.migratable if request_ids is None or r in request_ids]
        for request_id in chosen:
            for req_id in list(self.outputs.requests.get(request_id, ())):
                req, lease = self.scheduler.migrate_out(req_id, serve)
                if req is not None and lease is not None:
                    self._granting[lease.lease] = (req, lease.source(addresses))
                elif req is not None:
                    self.outputs.migrate(req)
            if request_ids is None:
                self._migrated_off.add(request_id)
            moved += 1
        if moved:
            logger.info("migrating %d request(s) off this replica", moved)
        self._wake.set()  # tell the workers to forget them (and grant their leases)
        return moved

    def applied(self, plan: StepPlan) -> None:
        """A plan's result is applied: the leases it granted are served now, a request taken back may have pulled
        the KV it left here (a lease released), and the lease timer follows the leases held."""
        released = self.scheduler.leases.released
        if released != self._released_seen:
            self._released_seen = released
            self._leases_released.set()
        if plan.kv_grants:
            self._granted(plan)
        self._arm_lease_timer()

    def migrate_without_kv(self, request_id: str | None = None) -> None:
        """The plans in flight were dropped (a lost rank, a failed step), or the request was aborted: leases not
        granted yet may never be. Their sequences (of `request_id`, or all) go out with states that recompute,
        and their blocks are freed."""
        for lease, (req, _) in list(self._granting.items()):
            if request_id is None or self.outputs.request_of.get(req.req_id) == request_id:
                del self._granting[lease]
                self.scheduler.leases.release_sequence(self.scheduler.blocks, req.req_id)
                self.outputs.migrate(req)

    def _granted(self, plan: StepPlan) -> None:
        """A plan's results are in: the leases it granted are served now, so their sequences' states go out."""
        for grant in plan.kv_grants:
            if (moving := self._granting.pop(grant.lease, None)) is not None:
                self.outputs.migrate(*moving)

    def kv_source(self, request_id: str) -> KVSource | None:
        """Where another replica pulls a finished prefill's prompt KV from; None when no lease is held for it."""
        lease = self.scheduler.leases.held.get(request_id)
        addresses = self.workers.capacity.kv_addresses
        return lease.source(list(addresses)) if lease is not None and addresses else None

    def release_kv(self, request_id: str) -> bool:
        """Free a request's leased blocks (a finished prefill's or its migrated sequences': pulled, or nobody
        will); False if none are held."""
        if not self.scheduler.release_kv(request_id):
            return False
        self._wake.set()  # the workers forget the lease with the next plan
        self._leases_released.set()
        return True

    def takes_back(self, request_id: str) -> bool:
        """Is this a request this replica migrated off, coming back (no other replica took it)? It runs on here,
        from the KV still leased for it where its lease is held, else by recompute, rather than be lost."""
        return request_id in self._migrated_off

    async def migrations_settled(self, timeout: float | None) -> bool:
        """Until no migrated sequence's KV waits here for its target (each confirmed, or its lease expired), at
        most `timeout` seconds: a drained replica serves the pulls before it goes. False if time ran out."""
        leases = self.scheduler.leases
        end = None if timeout is None else time.monotonic() + timeout
        while leases.num_migrations:
            self._leases_released.clear()
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self._leases_released.wait(), left)
            except TimeoutError:
                return False
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
            self._leases_released.set()
        self._arm_lease_timer()
