"""A request's way in and out of the scheduler: added (its handle, its speculation state, a migrated arrival's
pull), finished (out of its queue; a producer's prompt blocks held under its KV lease for the pull; its blocks
freed; the workers told to forget it; out of quarantine), or migrated to another replica with the KV its applied
steps wrote held under a lease."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_node.core.in_flight import InFlightLedger
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.leases import KVLeases, Lease
from scheduler_node.core.kv.precision import BlockFormat
from scheduler_node.core.migrations_in import MigrationsIn
from scheduler_node.core.quarantine import Quarantine
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request, Status
from scheduler_node.core.speculator import Speculator
from scheduler_node.core.step import prompt_blocks
from scheduler_node.core.worker_view import WorkerView


class Lifecycle:
    def __init__(
        self,
        queues: RequestQueues,
        blocks: BlockTable,
        view: WorkerView,
        leases: KVLeases,
        in_flight: InFlightLedger,
        quarantine: Quarantine,
        speculator: Speculator | None,
        migrations: MigrationsIn,
        clock: Callable[[], float],
    ) -> None:
        self.queues = queues
        self.blocks = blocks
        self.view = view
        self.leases = leases
        self.in_flight = in_flight
        self.quarantine = quarantine
        self.speculator = speculator
        self.migrations = migrations
        self.clock = clock

    def add(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue a request; `forks` (n > 1) start from its prompt's blocks once the prompt is computed."""
        self.queues.check_new([req, *(forks or [])])
        req.forks = tuple(forks or ())
        for r in [req, *req.forks]:
            self.queues.register(r)
            if self.speculator is None:
                r.spec = None
            else:
                self.speculator.admit(r)
            if r.migrated_in and r.kv_source is not None:
                self.migrations.arrive(r)
        self.queues.enqueue(req)

    def finish(self, req_id: str, status: Status) -> Request | None:
        """End a live request (abort, stop string, error, its own tokens) and free its blocks at once."""
        req = self.queues.remove(req_id)
        if req is None:
            return None
        if req.kv_lease:  # a prefill for another replica: its prompt's blocks wait under the lease for the pull
            ending = req.status if req.finished else status
            if ending in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH) and req.num_computed_tokens:
                blocks = prompt_blocks(req, self.blocks.block_size)
                self.leases.hold(self.blocks, req.req_id, req.kv_lease, blocks, self.clock())
            else:
                self.leases.revokes.append(req.kv_lease)
        if not req.finished:
            req.status = status
        self.quarantine.release(req_id)
        self.blocks.free(req.req_id)
        self.view.forget(req, preempted=False)
        return req

    def migrate_out(self, req_id: str, keep_kv: bool) -> tuple[Request | None, Lease | None]:
        """End a live sequence that moves to another replica (FINISHED_MIGRATED). With `keep_kv`, the blocks whose
        KV its applied steps wrote stay held under a lease for the target to pull (core/kv/leases.py); without,
        or when it has none on the device (waiting, swapped out, compact), they are freed with it."""
        req = self.queues.requests.get(req_id)
        lease = None
        if req is not None and keep_kv and (tokens := self._kv_written(req)) > 0:
            lease = self.leases.hold_sequence(self.blocks, req_id, tokens, self.clock())
        return self.finish(req_id, Status.FINISHED_MIGRATED), lease

    def _kv_written(self, req: Request) -> int:
        """Positions of `req` whose KV is on the device and final: all but its last token (the next step's input),
        less what plans in flight still compute. 0 when its blocks are elsewhere."""
        if req.status is not Status.RUNNING or req.swapped or self.blocks.format_of(req.req_id) is BlockFormat.COMPACT:
            return 0
        written = min(req.num_tokens - 1, req.num_computed_tokens)
        first = self.in_flight.first_computed(req)
        return written if first is None else min(written, first)
