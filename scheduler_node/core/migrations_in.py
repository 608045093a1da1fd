"""Live migration in: sequences resumed here from another replica with their KV leased on the source, the KV
imports (pulls) that bring it over, and how each sequence is counted (imported, or recomputed after all).

A migrated sequence with a KV source that holds no blocks yet is an arrival until it claims its blocks (admission,
or `Admission.pin_arrivals`, seat or no seat). Its import is pending until a plan carries it (`send`), then sent
until that plan's result is back (`settle`): a pull that failed makes it recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from proto.wire import KVImport
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.leases import KVLeases
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request, Status

logger = logging.getLogger(__name__)


class MigrationsIn:
    def __init__(
        self, queues: RequestQueues, blocks: BlockTable, leases: KVLeases, counters: SchedulerCounters
    ) -> None:
        self.queues = queues
        self.blocks = blocks
        self.leases = leases
        self.counters = counters
        self._arrivals: dict[Request, bool] = {}  # each with whether its wait for blocks was logged
        self._pulls: list[tuple[Request, KVImport]] = []  # not sent yet
        self._sent: dict[int, list[tuple[Request, KVImport]]] = {}  # by the plan that carries them

    def arrive(self, req: Request) -> None:
        self._arrivals[req] = False

    def arrivals(self) -> list[tuple[Request, bool]]:
        """The arrivals that hold no blocks yet, each with whether its wait was logged."""
        return list(self._arrivals.items())

    def claimed(self, req: Request) -> None:
        """An arrival that ended, or holds its blocks now."""
        del self._arrivals[req]

    def told(self, req: Request) -> None:
        """Its wait for blocks was logged."""
        self._arrivals[req] = True

    def pull(self, req: Request, imp: KVImport) -> None:
        """`req` starts with its KV imported by the next plan: its result settles it."""
        self._pulls.append((req, imp))

    def pulls_last(self, req: Request) -> bool:
        """Is the last import queued `req`'s (it claimed its blocks and pulls now)?"""
        return bool(self._pulls) and self._pulls[-1][0] is req

    def send(self, step_id: int) -> None:
        """The imports queued go out with this plan."""
        if self._pulls:  # a plan with imports has work: it is sent
            self._sent[step_id], self._pulls = self._pulls, []

    def clear(self) -> None:
        """Every plan in flight was dropped, and the blocks imports filled with it."""
        self._pulls, self._sent = [], {}

    def settle(self, step_id: int, failed_loads: Iterable[bytes]) -> None:
        """The KV imports this plan carried are done. One that claimed its blocks while waiting (`pin_arrivals`) and
        whose pull failed lets them go and will compute its tokens (a running one is left out by the workers and
        preempted: `Results`). A pull from a lease this replica holds itself (a request it migrated off, back)
        releases that lease at once: its KV is here twice."""
        if not self._sent:
            return
        failed = set(failed_loads)
        for req, imp in self._sent.pop(step_id, []):
            pinned, req.pulling = req.pulling, False
            # A partial block's key is b"" in any import: a failed one marks every import with one (a recompute).
            if failed.isdisjoint(imp.hashes):
                self.leases.release_lease(self.blocks, imp.lease)
            elif pinned and self.queues.is_live(req) and req.status is not Status.RUNNING:
                self.blocks.free(req.req_id)
                req.num_computed_tokens = 0
                if req.migration_imports:
                    self.pull_failed(req)

    def count(self, req: Request, ready: int, imported: int) -> None:
        """A migrated sequence starts here with `ready` positions' KV in place, `imported` of them pulled from its
        source: an import when they cover what its source held (the prefix cache may hold some), else a recompute."""
        req.migrated_in = False  # once: a later preemption recomputes it as any request
        source = req.kv_source
        if source is not None and source.tokens and ready >= source.tokens:
            self.counters.migrations_imported += 1
            req.migration_imports = True
        else:
            self.counters.migrations_recomputed += 1
            if source is None:
                why = "its source offered no KV (no exporter there, or it held no device blocks)"
            else:  # another KV format here, prefix caching off, or a layout whose partial block does not fit
                why = f"{ready} of the {source.tokens} positions its source holds can be imported here"
            logger.info("%s: migrated in, recomputes: %s", req.req_id, why)
        self.counters.migration_kv_tokens_imported += imported

    def pull_failed(self, req: Request) -> None:
        """A migrated sequence counted as importing its KV recomputes after all: its pull failed."""
        req.migration_imports = False
        self.counters.migrations_imported -= 1
        self.counters.migrations_recomputed += 1
        logger.info("%s: migrated in, recomputes: its KV pull failed (the worker's log says why)", req.req_id)
