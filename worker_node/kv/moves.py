"""A plan's KV moves on this rank, before its forward pass reads any block: swap out and in, tier moves (host RAM,
disk: worker_node/kv/tiers.py), copies (copy-on-write, compaction), and KV from other worlds (leases revoked and
granted, prefixes imported: worker_node/kv/handoff.py); and the requests whose KV a failed load left invalid,
which are left out of every step until the scheduler forgets them. The ModelRunner (worker_node/model_runner.py) is
composed of one of each; the plan's diffs (worker_node/plan_diffs.py) ask KVMoves to check its part of a plan."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from proto.wire import StepPlan, TierMove
from worker_node.kv.cache import KVCache, copy_blocks
from worker_node.kv.handoff import ImportRun, KVHandoff
from worker_node.kv.tiers import DISK, KVOffload, TierRun
from worker_node.runtime.parallel import Comm


@dataclass(slots=True)
class Moved:
    """What a plan's moves did (the failures: on any rank, so every rank leaves out the same requests)."""

    tiers: TierRun = field(default_factory=TierRun)
    imports: ImportRun = field(default_factory=ImportRun)
    failed_loads: list[TierMove] = field(default_factory=list)
    failed_stores: list[TierMove] = field(default_factory=list)

    @property
    def bad_blocks(self) -> set[int]:
        """The device blocks a failed load (a tier load, a KV import) should have filled."""
        return {m.dst for m in self.failed_loads} | {b for i in self.imports.failed for b in i.dst}

    @property
    def failed_hashes(self) -> list[bytes]:
        return [m.block_hash for m in self.failed_loads] + [h for i in self.imports.failed for h in i.hashes]


class KVMoves:
    def __init__(
        self,
        kv_cache: KVCache,
        host_cache: KVCache,
        compact_cache: KVCache,
        comm: Comm,
        device: torch.device,
        offload: KVOffload | None = None,  # KV offload tiers (host RAM, disk): the plans' tier moves
    ) -> None:
        self.kv_cache = kv_cache
        self.host_cache = host_cache
        self.compact_cache = compact_cache
        self.comm = comm
        self.device = device
        self.offload = offload
        self.num_host_blocks = host_cache[0].num_blocks if host_cache else 0
        self.handoff: KVHandoff | None = None  # disaggregated prefill/decode: leases served, prefixes pulled

    def check(self, plan: StepPlan, full_limit: int) -> None:
        """This worker can make the plan's moves, and every block id they name is in range (`full_limit`: the
        full pool's blocks)."""
        swapped = [d for d, _ in plan.swap_out] + [d for _, d in plan.swap_in]
        check_range(swapped, full_limit, "swapped block id (full blocks only)")
        check_range([h for _, h in plan.swap_out] + [h for h, _ in plan.swap_in], self.num_host_blocks, "swap block")
        if plan.kv_imports or plan.kv_grants:
            if self.handoff is None:
                raise ValueError("the plan moves KV between worlds but this worker has no KV transfer set up")
            check_range([b for imp in plan.kv_imports for b in imp.dst], full_limit, "imported block id")
            check_range([b for g in plan.kv_grants for b in g.blocks], full_limit, "leased block id")
        if plan.tier_moves:
            if self.offload is None:
                raise ValueError("the plan moves KV tier blocks but this worker has no offload tiers")
            self.offload.check(plan.tier_moves, full_limit)

    def revoke(self, plan: StepPlan) -> None:
        """Leases the scheduler revoked: before any block of theirs can be written again."""
        if plan.kv_revokes and self.handoff is not None:
            self.handoff.revoke(plan.kv_revokes)

    def run(self, plan: StepPlan) -> Moved:
        """The plan's block operations and KV imports, and which of its loads and disk writes failed anywhere."""
        tiers = self.run_block_ops(plan)
        imports = self._pull_imports(plan)
        failed_loads, failed_stores = self._failed_anywhere(plan, tiers)
        return Moved(tiers, imports, failed_loads, failed_stores)

    def run_block_ops(self, plan: StepPlan) -> TierRun:
        """Swap out, KV tier moves, copy (copy-on-write, compaction), swap in: before the forward pass reads any
        block. Tier moves follow the swap-out (a load may fill a block the swap-out reads) and precede the copies
        and swap-in (an offload reads a block they may overwrite). Returns what the tier moves did."""
        if (plan.swap_out or plan.swap_in) and not self.host_cache:
            raise RuntimeError("the plan swaps but this worker has no swap space")
        copy_blocks(self.kv_cache, self.host_cache, plan.swap_out)
        tiers = self.offload.run(plan.tier_moves, self.kv_cache) if self.offload is not None else TierRun()
        base = plan.compact_block_base
        if base:  # copy-on-write stays within a pool
            copy_blocks(self.kv_cache, self.kv_cache, [(s, d) for s, d in plan.block_copies if s < base])
            compact = [(s - base, d - base) for s, d in plan.block_copies if s >= base]
            copy_blocks(self.compact_cache, self.compact_cache, compact)
        else:
            copy_blocks(self.kv_cache, self.kv_cache, plan.block_copies)
        copy_blocks(self.host_cache, self.kv_cache, plan.swap_in)
        return tiers

    def grant(self, plan: StepPlan) -> None:
        """Leases granted to other worlds: served from now on, once this step's writes are done."""
        if plan.kv_grants and self.handoff is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the exporter's thread reads what this forward pass wrote
            self.handoff.grant(plan.kv_grants)

    def _failed_anywhere(self, plan: StepPlan, here: TierRun) -> tuple[list[TierMove], list[TierMove]]:
        """The plan's disk loads and disk writes that failed on any rank: every rank must leave out the same
        requests (the collectives and the stages' hand-offs need equal batches), and a block one rank could not
        write is missing from the world's disk tier. Only plans that move blocks to or from disk ask."""
        moves = [m for m in plan.tier_moves if DISK in (m.src_tier, m.dst_tier)]
        if not moves or self.comm.where.layout.world_size == 1:
            return here.failed, here.failed_stores
        failed_here = here.failed + here.failed_stores
        anywhere = self.comm.any_rank([m in failed_here for m in moves])
        failed = [m for m, bad in zip(moves, anywhere) if bad]
        return [m for m in failed if m.dst_tier != DISK], [m for m in failed if m.dst_tier == DISK]

    def _pull_imports(self, plan: StepPlan) -> ImportRun:
        """The plan's KV imports from other worlds; every rank reports the same failures (an import that failed
        on any rank leaves its requests out on all of them, so the TP/PP batches stay equal)."""
        if not plan.kv_imports or self.handoff is None:
            return ImportRun()
        run = self.handoff.pull(plan.kv_imports)
        if self.comm.where.layout.world_size > 1:
            anywhere = self.comm.any_rank([imp in run.failed for imp in plan.kv_imports])
            run.failed = [imp for imp, bad in zip(plan.kv_imports, anywhere) if bad]
        return run


class LoadFailures:
    """The held requests that read a block whose load failed (a tier load, a KV import): their KV is not valid, so
    they are never computed again; the scheduler has them recompute and tells this worker to forget them."""

    def __init__(self) -> None:
        self._handles: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._handles)

    def __contains__(self, handle: int) -> bool:
        return handle in self._handles

    def forget(self, handle: int) -> None:
        self._handles.discard(handle)

    def leave_out(self, bad: set[int], batch: HoldsBlocks) -> list[int]:
        """The held requests whose blocks include one of `bad`: left out of this step and of every later one."""
        if not bad:
            return []
        out = [h for h, blocks in batch.held_blocks() if h not in self._handles and not bad.isdisjoint(blocks)]
        self._handles.update(out)
        return out

    def kept(self, plan: StepPlan, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The plan's rows (in its order: new requests, cached ones, packed decodes) and counts, without those of
        requests left out."""
        if not self._handles:
            return rows, counts
        handles = [r.handle for r in plan.new_requests] + [r.handle for r in plan.cached_requests]
        handles += plan.decodes()[0]
        kept = [h not in self._handles for h in handles]
        return rows[kept], counts[kept]


class HoldsBlocks(Protocol):
    """The input batch as the load failures see it (worker_node/input_batch.py): each held request's blocks."""

    def held_blocks(self) -> Iterator[tuple[int, list[int]]]: ...


def check_range(values: list[int], limit: int, what: str) -> None:
    bad = next((v for v in values if not 0 <= v < limit), None)
    if bad is not None:
        raise ValueError(f"{what} {bad} is outside [0, {limit})")
