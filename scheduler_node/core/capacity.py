"""What the KV cache holds and changing it at run time: the longest request it holds now (`max_model_len`),
resizing the usable blocks (ResizeCache), compaction, and a world that came back smaller. Which blocks move where is
core/kv/relocation.py's; the workers learn of the moves through their view."""

from __future__ import annotations

import time

from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.kv import relocation as block_relocation
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request
from scheduler_node.core.worker_view import WorkerView


class Capacity:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockTable,
        queues: RequestQueues,
        view: WorkerView,
        counters: SchedulerCounters,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.queues = queues
        self.view = view
        self.counters = counters

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
        return [
            r for r in self.queues.requests.values() if r.kv_precision != "compact" and r.num_tokens_at_most > limit
        ]

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
        return self._tell_workers(block_relocation.resize(self.blocks, num_blocks))

    def maybe_compact(self, step_id: int) -> None:
        """Every `compaction_interval` steps, pack live blocks low (so a later shrink has less to move)."""
        interval = self.config.compaction_interval
        if not interval or step_id % interval:
            return
        start = time.perf_counter()
        moves = block_relocation.compact(self.blocks, self.config.compaction_max_moves)
        self.counters.compaction_moves += self._tell_workers(moves)
        self.counters.compaction_seconds += time.perf_counter() - start

    def fit(self, num_blocks: int, num_host_blocks: int, num_compact_blocks: int | None = None) -> None:
        """The world came back holding fewer blocks than before (a replacement could not allocate the world's
        size): only that many are handed out from now on. Called on an empty table, right after a restart."""
        bt = self.blocks
        block_relocation.resize(bt, min(num_blocks, bt.usable_blocks))
        compact = bt.num_compact_blocks if num_compact_blocks is None else num_compact_blocks
        if num_host_blocks < bt.num_host_blocks or compact < bt.num_compact_blocks:
            bt.reset(min(num_host_blocks, bt.num_host_blocks), min(compact, bt.num_compact_blocks))

    def _tell_workers(self, moves: block_relocation.Moves) -> int:
        """The (index, block) replacements of moved blocks go to the workers with the next plan; how many."""
        requests = self.queues.requests
        return self.view.replace_blocks({requests[req_id].handle: changes for req_id, changes in moves.items()})
