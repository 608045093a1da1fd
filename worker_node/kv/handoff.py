"""A rank's part in disaggregated prefill/decode: what a plan's `kv_revokes`, `kv_imports` and `kv_grants` do.

A prefill world's ranks each run a `KVExporter` (exporter.py); the plan that computes a prefill's
last prompt chunk grants a lease on its blocks once the forward pass has written them, and a later plan revokes it
(pulled, aborted or timed out) before those blocks can be handed out again. A decode world's rank r pulls a
request's prefix from the producer's rank r (its `KVImport`) after the plan's block operations (from a producer world
of another TP size, each rank pulls its KV heads from the producer ranks of its stage holding them); a pull that fails
(the producer gone, the lease expired, a corrupted chunk, a timeout) is reported, and the scheduler has the
request compute those blocks instead (`StepResult.failed_loads`, as a failed disk-tier load). Between processes
of one host a pull goes through a staging buffer (`same_host`, `--kv-transfer-mode auto`), else by frames.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from proto.drop_log import DropLog
from proto.kv_transfer import KVLayout, KVTransferError, head_sources
from proto.wire import KVGrant, KVImport
from worker_node.kv.cache import KVCache
from worker_node.kv.transfer.exporter import KVExporter, cache_layout, pull_blocks
from worker_node.runtime.parallel import ParallelRank

logger = logging.getLogger(__name__)

PULL_TIMEOUT_S = 10.0  # a producer silent this long mid-pull is gone: the request recomputes its prefix


@dataclass(slots=True)
class ImportRun:
    """What a plan's imports did: those that failed (their destination blocks hold no valid KV), time, bytes."""

    failed: list[KVImport] = field(default_factory=list)
    ms: float = 0.0
    bytes: int = 0


class KVHandoff:
    """One rank's exporter (when it serves leases) and its pulls."""

    def __init__(
        self,
        cache: KVCache,
        layout: KVLayout,
        rank: int,
        exporter: KVExporter | None = None,
        curve_dir: str | Path | None = None,
        timeout_s: float = PULL_TIMEOUT_S,
        same_host: bool = True,
    ) -> None:
        self.cache = cache
        self.layout = layout
        self.rank = rank
        self.exporter = exporter
        self.curve_dir = curve_dir
        self.timeout_s = timeout_s
        self.same_host = same_host  # ask a producer of this host for a staging buffer (--kv-transfer-mode auto)
        # Imports that failed: a producer that answers garbage (or is gone) fails every import of every plan, so they
        # are counted and logged at a bounded rate (proto/drop_log.py); each one is reported to the scheduler anyway.
        self.failures = DropLog("kv_imports", logger)

    @property
    def address(self) -> str:
        return self.exporter.address if self.exporter is not None else ""

    def revoke(self, leases: list[bytes]) -> None:
        if self.exporter is not None:
            for lease in leases:
                self.exporter.revoke(lease)  # waits for a pull in progress on it: its blocks are read no more

    def grant(self, grants: list[KVGrant]) -> None:
        if grants and self.exporter is None:
            raise ValueError("the plan grants KV leases but this worker serves none (--kv-role decode)")
        for g in grants:
            assert self.exporter is not None
            self.exporter.grant(g.lease, g.blocks)

    def pull(self, imports: list[KVImport]) -> ImportRun:
        """Each import's blocks from its producer rank, in order; a failure is logged and reported, not raised."""
        run = ImportRun()
        start = time.perf_counter()
        for imp in imports:
            try:
                run.bytes += self._pull_one(imp)
            except (KVTransferError, OSError) as exc:
                self.failures.drop("a KV import of %d block(s) failed (recomputed instead): %s", len(imp.dst), exc)
                run.failed.append(imp)
        run.ms = (time.perf_counter() - start) * 1e3
        return run

    def _pull_one(self, imp: KVImport) -> int:
        """One import: from the producer's rank of this index when the worlds have one shape, else head by head
        from the producer ranks of this stage holding this rank's heads (other TP sizes, the same PP size)."""
        pp = self.layout.pipeline_parallel_size
        if len(imp.addresses) % pp:
            raise KVTransferError(f"a producer world of {len(imp.addresses)} ranks cannot have {pp} pipeline stages")
        producer_tp = len(imp.addresses) // pp
        if producer_tp == self.layout.tensor_parallel_size:
            return pull_blocks(
                imp.addresses[self.rank], imp.lease, self.cache, self.layout, imp.src, imp.dst,
                self.timeout_s, self.curve_dir, same_host=self.same_host,
            )  # fmt: skip
        moved = 0
        for tp_rank, heads, dst_heads in head_sources(self.layout, producer_tp):
            address = imp.addresses[self.layout.pipeline_rank * producer_tp + tp_rank]
            moved += pull_blocks(
                address, imp.lease, self.cache, self.layout, imp.src, imp.dst, self.timeout_s, self.curve_dir,
                heads=heads, dst_heads=dst_heads, same_host=self.same_host,
            )  # fmt: skip
        return moved

    def close(self) -> None:
        self.failures.flush()
        if self.exporter is not None:
            self.exporter.close()


def make_handoff(
    cache: KVCache,
    where: ParallelRank,
    serve: bool,
    host: str = "127.0.0.1",
    port: int = 0,
    curve_dir: str | Path | None = None,
    model: str = "",
    total_kv_heads: int = 0,
    same_host: bool = True,
) -> KVHandoff:
    """A rank's KV hand-off (a runner's `handoff`): it pulls prefixes, and with `serve` also serves leases on an
    exporter bound at host:port (0: a free port) on its device cache. `total_kv_heads`: the model's (needed to pair
    with a world of another TP size when KV heads are replicated). `same_host`: pulls between processes of one host
    go through a staging buffer (worker_node/kv/transfer/staging.py); False: frames over TCP only, both ways."""
    pp = where.layout.pipeline_parallel_size
    layout = cache_layout(cache, where.tp_size, where.tp_rank, pp, where.stage, model, total_kv_heads)
    exporter = KVExporter(cache, layout, host, port, curve_dir, same_host=same_host) if serve else None
    return KVHandoff(cache, layout, where.rank, exporter, curve_dir, same_host=same_host)
