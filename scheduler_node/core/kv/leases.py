"""Disaggregated prefill/decode in the scheduler: leases on a prefill's prompt blocks, imports into a decode's.

Producer (a prefill replica): a request submitted with `kv_produce` computes its prompt and samples one token; the
plan that computes its last prompt chunk grants its workers a lease (a random 16-byte secret) on the prompt's full
blocks but the last token's (`KVGrant`), and when the request ends by its tokens those blocks stay held under the
lease (`KVLeases.hold`) instead of being freed, until the lease is released: pulled (the router says so), aborted,
or after its timeout (the engine core arms it). A release frees the blocks and revokes the lease on the workers in
the next plan, before those blocks can be handed out again.

Consumer (a decode replica): a request submitted with a `KVSource` (the producer's exporter addresses, one per
rank, the lease and the producer's block ids) starts like a prefix hit: the blocks its device prefix cache lacks
are allocated and filled by a `KVImport` in the plan (worker_node/kv/handoff.py), registered under their chained
hashes, and counted as computed; the request computes the rest (at least its last prompt token, as after any
prefix hit) and samples its own first token. A pull that fails comes back as failed loads: the scheduler forgets
those blocks and the request computes them (`Scheduler._recompute_failed_loads`). The source is used once.

Live migration (core/migration.py) uses the same path for a running sequence: the source keeps every block whose
KV its applied steps wrote (`hold_sequence`, keyed by the sequence's id: a request's n sequences each get one),
including the partial last block, and the state it hands over names them with `tokens`, the positions they hold;
the target imports them all (the partial block unregistered) and computes only the last token, so the KV it reads
is the very KV an undisturbed run reads. Those leases are shorter (`migration_lease_s`): the target pulls on
arrival, seat or no seat (`Admission.pin_arrivals`), and one that pulls from its own lease releases it then.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from proto.wire import KVGrant, KVImport
from scheduler_node.core.kv.block_ops import BlockHash
from scheduler_node.core.kv.block_table import BlockTable

logger = logging.getLogger(__name__)

LEASE_BYTES = 16
DEFAULT_LEASE_S = 30.0  # a lease nobody pulls or releases is freed after this long
DEFAULT_MIGRATION_LEASE_S = 10.0  # a migrated sequence's: its target pulls within a step of getting the state


def new_lease() -> bytes:
    return secrets.token_bytes(LEASE_BYTES)


@dataclass(frozen=True, slots=True)
class KVSource:
    """Where a decode request's prompt KV waits: the producer world's KV exporters (by rank), the lease, and the
    producer's block ids of the prompt's first full blocks, in order. A migrated sequence's also says how many
    positions they hold (`tokens`), its partial last block included; 0: full blocks only."""

    addresses: tuple[str, ...]
    lease: bytes
    blocks: tuple[int, ...]
    tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.lease) != LEASE_BYTES:
            raise ValueError(f"kv_source.lease: must be {LEASE_BYTES} bytes, got {len(self.lease)}")
        if not self.addresses or any(not a or len(a) > 256 for a in self.addresses):
            raise ValueError("kv_source.addresses: one HOST:PORT per producer rank, each at most 256 characters")
        if any(b < 0 for b in self.blocks):
            raise ValueError("kv_source.blocks: block ids are >= 0")
        if self.tokens < 0:
            raise ValueError(f"kv_source.tokens: must be >= 0, got {self.tokens}")

    def full_blocks(self, block_size: int) -> int:
        """The source's blocks that are full (the one after them, when `tokens` says so, is partial)."""
        return self.tokens // block_size if self.tokens else len(self.blocks)

    def partial_tokens(self, block_size: int) -> int:
        """Positions of the partial block after the full ones (0: none offered)."""
        if not self.tokens or len(self.blocks) <= self.tokens // block_size:
            return 0
        return self.tokens % block_size


@dataclass(slots=True)
class Lease:
    request_id: str  # the producer request's id (the door's, without the sequence suffix)
    key: str  # the block table's holder of its blocks
    lease: bytes
    blocks: list[int]
    expires: float
    tokens: int = 0  # a migrated sequence's: the positions its blocks hold (0: a prefill's full blocks)

    def source(self, addresses: list[str]) -> KVSource:
        return KVSource(tuple(addresses), self.lease, tuple(self.blocks), self.tokens)


@dataclass(slots=True)
class KVLeases:
    """The leases this replica holds for other replicas, and what the next plan owes its workers."""

    lease_s: float = DEFAULT_LEASE_S
    migration_lease_s: float = DEFAULT_MIGRATION_LEASE_S
    held: dict[str, Lease] = field(default_factory=dict)  # by producer request id, or migrated sequence id
    grants: list[KVGrant] = field(default_factory=list)
    imports: list[KVImport] = field(default_factory=list)
    revokes: list[bytes] = field(default_factory=list)
    imported_blocks: int = 0  # counters: blocks a decode pulled instead of computing
    released: int = 0
    expired: int = 0

    @property
    def pending(self) -> bool:
        """Something the workers must be told even if nothing else runs (a revoke)."""
        return bool(self.revokes or self.grants or self.imports)

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self.held.values())

    def hold(self, table: BlockTable, req_id: str, lease: bytes, num_blocks: int, now: float) -> Lease | None:
        """Keep the first `num_blocks` blocks of a finished producer request (before `table.free(req_id)`)."""
        blocks = table.blocks_of(req_id)[:num_blocks]
        request_id = req_id.rpartition("#")[0] or req_id
        if not blocks:
            self.revokes.append(lease)
            return None
        self.release(table, request_id)  # the same id produced again before its last lease was released
        key = f"lease:{lease.hex()}"
        table.acquire(key, blocks)
        self.held[request_id] = Lease(request_id, key, lease, blocks, now + self.lease_s)
        return self.held[request_id]

    def hold_sequence(self, table: BlockTable, req_id: str, tokens: int, now: float) -> Lease | None:
        """Keep the blocks of a migrated sequence's first `tokens` positions under a new lease, granted to its
        workers by the next plan (before `table.free(req_id)`); None when it has none."""
        blocks = table.blocks_of(req_id)[: table.blocks_for(tokens)]
        if not blocks:
            return None
        lease = new_lease()
        key = f"lease:{lease.hex()}"
        table.acquire(key, blocks)
        held = Lease(req_id.rpartition("#")[0] or req_id, key, lease, blocks, now + self.migration_lease_s, tokens)
        self.held[req_id] = held
        self.grants.append(KVGrant(lease, blocks))
        return held

    @property
    def num_migrations(self) -> int:
        """Leases held for migrated sequences (their targets have not confirmed yet)."""
        return sum(1 for lease in self.held.values() if lease.tokens)

    def release(self, table: BlockTable, request_id: str) -> bool:
        """Free the leases of a request (a prefill's, or its migrated sequences'): pulled, aborted; its workers
        forget them with the next plan."""
        keys = [k for k, lease in self.held.items() if k == request_id or lease.request_id == request_id]
        for key in keys:
            self._drop(table, self.held.pop(key))
        return bool(keys)

    def release_sequence(self, table: BlockTable, req_id: str) -> None:
        """Free one migrated sequence's lease (its state goes out without it)."""
        lease = self.held.pop(req_id, None)
        if lease is not None:
            self._drop(table, lease)

    def release_lease(self, table: BlockTable, lease: bytes) -> bool:
        """Free the lease with these bytes if this replica holds it (its target is this replica: it pulled)."""
        key = next((k for k, held in self.held.items() if held.lease == lease), None)
        if key is None:
            return False
        self._drop(table, self.held.pop(key))
        return True

    def _drop(self, table: BlockTable, lease: Lease) -> None:
        table.free(lease.key)
        self.grants = [g for g in self.grants if g.lease != lease.lease]  # not granted yet: never will be
        self.revokes.append(lease.lease)
        self.released += 1

    def expire(self, table: BlockTable, now: float) -> list[str]:
        """Release the leases whose time is up; their request ids."""
        late = [rid for rid, lease in self.held.items() if lease.expires <= now]
        for rid in late:
            logger.info("KV lease of %s expired unpulled: its blocks are freed", rid)
            self._drop(table, self.held.pop(rid))
            self.expired += 1
        return late

    def clear(self) -> None:
        """The block table was replaced (a lost rank): every lease is gone with it."""
        self.revokes += [lease.lease for lease in self.held.values()]
        self.held.clear()
        self.grants.clear()
        self.imports.clear()

    def import_prefix(self, source: KVSource, first: int, dst: list[int], hashes: list[BlockHash]) -> None:
        """Blocks `first`.. of the source's prompt, pulled into `dst` by the next plan."""
        src = list(source.blocks[first : first + len(dst)])
        keys = list(hashes) + [b""] * (len(dst) - len(hashes))  # a migrated sequence's partial block has no hash
        self.imports.append(KVImport(list(source.addresses), source.lease, src, dst, keys))
        self.imported_blocks += len(dst)
