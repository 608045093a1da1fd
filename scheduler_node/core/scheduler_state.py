"""The scheduler's state: its queues, the requests it knows by id and by handle, its block table, and taking
tokens of a request into a plan. The step loop (scheduler.py), admission (admission.py), preemption
(preemption.py) and results (results.py) are its methods, each in its own module; `Scheduler` joins them.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proto.wire import ExecutionMode, KVGrant, KVImport, StepPlan, pack_int32
from scheduler_node.core import block_relocation
from scheduler_node.core.block_table import BlockFormat, BlockTable, Written
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.in_flight import InFlightLedger, SentPlan
from scheduler_node.core.kv_events import DEVICE, KVEventSink
from scheduler_node.core.kv_handoff import KVLeases, Lease
from scheduler_node.core.kv_precision import CompactKV
from scheduler_node.core.kv_tiers import KVTiers
from scheduler_node.core.policy import Policy
from scheduler_node.core.quarantine import Quarantine
from scheduler_node.core.request import Request, Status
from scheduler_node.core.speculator import Speculator
from scheduler_node.core.worker_view import WorkerView

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PreemptionCosts:
    """What elastic preemption weighs: recomputing a victim's tokens vs moving its blocks out and back."""

    ms_per_token: float = 1.0  # refreshed from the workers' step timings
    bytes_per_block: int = 0
    swap_bytes_per_s: float = 0.0  # 0: unknown, swap is never assumed cheaper

    def recompute_ms(self, req: Request) -> float:
        return req.num_computed_tokens * self.ms_per_token

    def swap_ms(self, num_blocks: int) -> float:
        if self.swap_bytes_per_s <= 0:
            return float("inf")
        return 2 * num_blocks * self.bytes_per_block / self.swap_bytes_per_s * 1e3

    def observe(self, execute_ms: float, num_tokens: int) -> None:
        if num_tokens > 0 and execute_ms > 0:
            self.ms_per_token = 0.9 * self.ms_per_token + 0.1 * execute_ms / num_tokens


@dataclass(slots=True)
class SchedulerCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    compaction_moves: int = 0
    compaction_seconds: float = 0.0
    steps: int = 0
    worker_idle_ms: float = 0.0  # summed over steps: the gap the workers waited between steps
    interrupted_steps: int = 0  # steps whose compute was skipped for a request that outranked them
    scheduled_tokens: int = 0  # tokens computed by the workers, recomputation included
    # Live migration: sequences resumed here from another replica, by KV import or by recompute, and the positions
    # whose KV they planned to import (a pull that fails later is recomputed: core/results.py).
    migrations_imported: int = 0
    migrations_recomputed: int = 0
    migration_kv_tokens_imported: int = 0


class SchedulerState:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        policy: Policy | None = None,
        mode: ExecutionMode | None = None,
        num_host_blocks: int = 0,
        costs: PreemptionCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
        tiers: KVTiers | None = None,
        num_compact_blocks: int = 0,
        precision: CompactKV | None = None,
    ) -> None:
        self.config = config
        self.mode = mode or ExecutionMode()
        self.clock = clock
        self.policy = policy or Policy()
        self.blocks = BlockTable(
            num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks, num_compact_blocks
        )
        self.precision = precision or CompactKV()
        self.tiers = tiers if tiers is not None and tiers.enabled and config.enable_prefix_caching else None
        self.kv_events: KVEventSink | None = None  # set by attach_kv_events (a replica that publishes KV events)
        self._attach_tiers()
        self.costs = costs or PreemptionCosts()
        self.counters = SchedulerCounters()
        self.requests: dict[str, Request] = {}
        self._by_handle: dict[int, Request] = {}
        self._handles = itertools.count()  # never reused: a late result of a plan in flight names no one else
        # Kept in the policy's order when it is stable (the order of two requests never changes), else in arrival.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Running requests that may have more than one token to compute (admitted, or rolled back by an
        # interrupt): the only ones whose prefill can set the floor. Dropped once they caught up.
        self._catching_up: set[Request] = set()
        self.view = WorkerView(self.mode.tokens_in_plan, config.max_loras, config.max_cpu_loras)
        self.in_flight = InFlightLedger(self.mode.disjoint_plans)
        self.quarantine = Quarantine()  # suspects of a step that failed with nobody blamed (core/quarantine.py)
        self._step_id = 0
        # Speculative decoding, when configured. With tokens in plans (P > 1 stages) the ranks learn how many
        # proposals were accepted from the request's next plan: speculation runs one plan at a time, so that plan
        # is built after the result (`Speculator.settle`) and carries the rolled-back computed tokens.
        spec = config.speculative
        self.speculator = Speculator(spec) if spec is not None else None
        self.leases = KVLeases()  # disaggregated prefill/decode (core/kv_handoff.py)
        # Live migration in (`Admission._pin_arrivals`): migrated sequences with a KV source that hold no blocks yet
        # (each with whether its wait for blocks was logged), and the KV imports of migrated sequences, not sent
        # yet, then by the plan that carries them until its result is back (`Results._settle_pulls`).
        self._arrivals: dict[Request, bool] = {}
        self._pulls: list[tuple[Request, KVImport]] = []
        self._pulls_sent: dict[int, list[tuple[Request, KVImport]]] = {}

    @property
    def num_preemptions(self) -> int:
        return self.counters.preemptions_recompute + self.counters.preemptions_swap

    def add(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue a request; `forks` (n > 1) start from its prompt's blocks once the prompt is computed."""
        for r in [req, *(forks or [])]:
            if r.req_id in self.requests:
                raise KeyError(f"request {r.req_id!r} is already live")
        req.forks = tuple(forks or ())
        for r in [req, *req.forks]:
            r.handle = next(self._handles)
            if self.speculator is None:
                r.spec = None
            else:
                self.speculator.admit(r)
            self.requests[r.req_id] = r
            self._by_handle[r.handle] = r
            if r.migrated_in and r.kv_source is not None:
                self._arrivals[r] = False
        self._enqueue(req)

    def finish(self, req_id: str, status: Status) -> Request | None:
        """End a live request (abort, stop string, error) and free its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        del self._by_handle[req.handle]
        if req.status is Status.RUNNING or req.finished:  # finished by its own tokens: still in running
            self.running.remove(req)
            self._catching_up.discard(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv_lease:  # a prefill for another replica: its prompt's blocks wait under the lease for the pull
            ending = req.status if req.finished else status
            if ending in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH) and req.num_computed_tokens:
                self.leases.hold(self.blocks, req.req_id, req.kv_lease, self._prompt_blocks(req), self.clock())
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
        KV its applied steps wrote stay held under a lease for the target to pull (core/kv_handoff.py); without,
        or when it has none on the device (waiting, swapped out, compact), they are freed with it."""
        req = self.requests.get(req_id)
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

    def request_of(self, handle: int) -> Request | None:
        """The live request a plan or a result names by this handle."""
        return self._by_handle.get(handle)

    def resize(self, num_blocks: int) -> int:
        """Change the usable KV blocks at run time; returns how many live blocks move (on the next step). Raises
        MemoryError, changing nothing, when live requests would not fit: their blocks, or any one of them at its
        longest (it would wait forever)."""
        stranded = self.stranded(num_blocks)
        if stranded:
            need, holds = max(r.num_tokens_at_most for r in stranded), self.max_model_len_for(num_blocks)
            raise MemoryError(
                f"{len(stranded)} live sequence(s) may grow to {need} tokens (prompt + max_tokens), more than "
                f"{num_blocks} block(s) hold ({holds} tokens): let them finish or abort them"
            )
        return self.view.replace_blocks(self._by_handles(block_relocation.resize(self.blocks, num_blocks)))

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + max_tokens) the cache holds now: the configured max_model_len, capped by
        the usable blocks (a ResizeCache shrink, a smaller replacement worker). Doors validate against it."""
        return self.max_model_len_for(self.blocks.usable_blocks)

    def max_model_len_for(self, usable_blocks: int) -> int:
        tokens = usable_blocks * self.blocks.block_size
        configured = self.config.max_model_len
        return min(configured, tokens) if configured else tokens

    def stranded(self, usable_blocks: int) -> list[Request]:
        """Live sequences that could never finish in that many usable blocks: validated against a longer
        max_model_len than those hold. Compact ones (kv_precision="compact") live in their own pool, which
        neither a resize nor a smaller replacement of the full blocks changes."""
        limit = self.max_model_len_for(usable_blocks)
        return [r for r in self.requests.values() if r.kv_precision != "compact" and r.num_tokens_at_most > limit]

    def _by_handles(self, updates: dict[str, list[tuple[int, int]]]) -> dict[int, list[tuple[int, int]]]:
        return {self.requests[req_id].handle: changes for req_id, changes in updates.items()}

    def _enqueue(self, req: Request) -> None:
        """Into waiting: in its place under a stable policy order (so no step sorts the queue), else at the end."""
        if self.policy.stable_order:
            now = self.clock()
            bisect.insort(self.waiting, req, key=lambda r: self.policy.sort_key(r, now))
        else:
            self.waiting.append(req)

    def _start_running(self, req: Request) -> None:
        self.waiting.remove(req)
        if self.policy.stable_order:
            now = self.clock()
            bisect.insort(self.running, req, key=lambda r: self.policy.sort_key(r, now))
        else:
            self.running.append(req)
        req.status = Status.RUNNING
        self._catching_up.add(req)

    @property
    def has_work(self) -> bool:
        ops = self.blocks.ops
        pending_ops = bool(ops.copy or ops.swap_out or ops.swap_in)
        return bool(self.waiting or self.running or self.view.has_notices or pending_ops or self.leases.pending)

    def _prompt_blocks(self, req: Request) -> int:
        """The blocks of a prompt that a prefix hit may reuse (its last token is always computed)."""
        return (len(req.prompt_token_ids) - 1) // self.blocks.block_size

    def expire_leases(self) -> list[str]:
        """Release the KV leases whose time is up (the engine's timer); their request ids."""
        return self.leases.expire(self.blocks, self.clock())

    def release_kv(self, request_id: str) -> bool:
        """Free a producer request's leased blocks (pulled, or its client gave up); False if none are held."""
        return self.leases.release(self.blocks, request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """From now on every hash that enters or leaves the prefix cache (any tier) is reported to `sink`."""
        self.kv_events = sink
        self._attach_tiers()

    def _attach_tiers(self) -> None:
        """Cached blocks the device pool hands out again go to the offload tiers (when there are any); the prefix
        cache's changes go to the KV event sink (when there is one)."""
        if self.tiers is not None:
            self.blocks.on_evict = self.tiers.offload
            self.tiers.events = self.kv_events
        self.blocks.events = self.kv_events

    def _new_table(self, num_host_blocks: int, num_compact_blocks: int) -> None:
        """An empty block table of the same size (a lost rank, a smaller world): nothing is cached any more."""
        old = self.blocks
        self.blocks = BlockTable(
            old.num_blocks, old.block_size, old.enable_prefix_caching, num_host_blocks, num_compact_blocks
        )
        block_relocation.resize(self.blocks, old.usable_blocks)
        if self.kv_events is not None:
            self.kv_events.cleared(DEVICE)

    @staticmethod
    def _tokens_to_schedule(req: Request) -> int:
        """Tokens to compute: up to the known ones plus the sampled ones still in flight (async
        scheduling), never past max_tokens."""
        num_output = len(req.output_token_ids)
        if num_output + req.num_placeholders >= req.stop.max_tokens:
            return 0
        return len(req.prompt_token_ids) + num_output + req.num_placeholders - req.num_computed_tokens

    def _take(
        self,
        req: Request,
        n: int,
        samples: bool,
        plan: StepPlan,
        sent: SentPlan,
        written: Written,
        drafts: list[int] | None = None,
    ) -> None:
        """`req` computes `n` tokens in this plan, its last ones if `samples` (the step then samples its next
        token); its blocks are `written` already. With `drafts`, its last n - 1 tokens are these proposals, which
        the result accepts or not (`update` rolls the rejected ones back)."""
        first = req.num_computed_tokens
        self.view.add_to_plan(req, plan, first, n, self.blocks, written, drafts)
        req.num_computed_tokens = first + n
        if req.kv_lease and samples and not req.output_token_ids:  # a producer's prompt is computed by this plan
            blocks = self.blocks.blocks_of(req.req_id)[: self._prompt_blocks(req)]
            self.leases.grants.append(KVGrant(req.kv_lease, blocks))
        if samples:
            req.num_placeholders += 1  # this step samples a token the scheduler learns of later
        sent.add(req, n, samples, len(drafts) if drafts else 0)

    @staticmethod
    def pack_decodes(plan: StepPlan, sent: SentPlan) -> None:
        """The plan's steady decodes, packed (StepPlan.decode_handles): two int32 arrays, not a record each."""
        if sent.decode_handles:
            plan.decode_handles = pack_int32(sent.decode_handles)
            plan.decode_computed = pack_int32(sent.decode_firsts)

    def _take_decodes(self, reqs: list[Request], firsts: list[int], plan: StepPlan, sent: SentPlan) -> None:
        """`_take` of steady decodes, together: each computed one token within its own last block (no block
        added or copied) from `firsts[i]` and samples; the workers hold each one (one stage: they append its tokens
        themselves). None proposes or is a producer's (no drafts, no KV grant: the loop in `schedule` leaves those
        to `_take`). The loop advanced each request already (its computed tokens and placeholder); here the ledger
        takes them column by column, and the plan gets them packed when it is complete (`pack_decodes`)."""
        sent.add_decodes(reqs, firsts)
