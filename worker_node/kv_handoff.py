"""A rank's part in disaggregated prefill/decode: what a plan's `kv_revokes`, `kv_imports` and `kv_grants` do.

A prefill world's ranks each run a `KVExporter` (worker_node/kv_transfer.py); the plan that computes a prefill's
last prompt chunk grants a lease on its blocks once the forward pass has written them, and a later plan revokes it
(pulled, aborted or timed out) before those blocks can be handed out again. A decode world's rank r pulls a
request's prefix from the producer's rank r (its `KVImport`) after the plan's block operations; a pull that fails
(the producer gone, the lease expired, a corrupted chunk, a timeout) is reported, and the scheduler has the
request compute those blocks instead (`StepResult.failed_loads`, as a failed disk-tier load).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from proto.kv_transfer import KVLayout, KVTransferError
from proto.wire import KVGrant, KVImport
from worker_node.kv_cache import KVCache
from worker_node.kv_transfer import KVExporter, cache_layout, pull_blocks
from worker_node.parallel import ParallelRank

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
    ) -> None:
        self.cache = cache
        self.layout = layout
        self.rank = rank
        self.exporter = exporter
        self.curve_dir = curve_dir
        self.timeout_s = timeout_s

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
            if self.rank >= len(imp.addresses):
                logger.warning("KV import names %d producer ranks; this is rank %d", len(imp.addresses), self.rank)
                run.failed.append(imp)
                continue
            try:
                run.bytes += pull_blocks(
                    imp.addresses[self.rank], imp.lease, self.cache, self.layout, imp.src, imp.dst,
                    self.timeout_s, self.curve_dir,
                )  # fmt: skip
            except (KVTransferError, OSError) as exc:
                logger.warning("KV import of %d block(s) failed (recomputed instead): %s", len(imp.dst), exc)
                run.failed.append(imp)
        run.ms = (time.perf_counter() - start) * 1e3
        return run

    def close(self) -> None:
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
) -> KVHandoff:
    """A rank's KV hand-off (a runner's `handoff`): it pulls prefixes, and with `serve` also serves leases on an
    exporter bound at host:port (0: a free port) on its device cache."""
    layout = cache_layout(cache, where.tp_size, where.tp_rank, where.layout.pipeline_parallel_size, where.stage, model)
    exporter = KVExporter(cache, layout, host, port, curve_dir) if serve else None
    return KVHandoff(cache, layout, where.rank, exporter, curve_dir)
