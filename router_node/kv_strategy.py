"""`--routing-strategy kv`: route on the replicas' exact prefix caches (their KV events), against their load.

The router hashes the request's blocks the way the scheduler does (scheduler_node/core/kv/block_table.py:
hash_block, chained, seeded by the request's cache_salt, the replica's block size): token ids as given, a text
prompt through the model's tokenizer (with its special tokens, as the doors encode it), messages through its chat
template (scheduler_node/text/tokenizer.py; the folder is the replica's `tokenizer=DIR`). For each candidate,
`cached` is how many of those blocks, from the first, its index says it holds (any tier: a cpu or disk block is
loaded back instead of computed), or were sent to it by a request routed in the last PENDING_S (as Dynamo's
router predicts them: the events come only once they are computed); a replica that is down or resynchronizing
holds nothing. The cost, after NVIDIA Dynamo's KV router (the prefill a replica saves against the work it has,
in blocks):

    cost = overlap_weight x (prompt_blocks - cached) + (prefill_ahead + active + others) / weight

`prefill_ahead` is the prompt blocks the replica has yet to compute for the requests this router sent it (those
not cached when each was routed, until its first token), `active` the blocks those requests hold until their
streams close, this one's among them (a block that several share counts once: a tenant's requests share its
context), both from router_node/kv_load.py; `others` the requests its GetStats counts beyond this
router's open streams (another router's, direct clients), each as a prompt like this one. So a request ahead that
is a cache hit adds no prefill, only the blocks it holds (none that this one shares), and a replica that holds the
prefix keeps it while its work stays below what computing the prompt elsewhere would cost. A higher weight follows
the cache harder (more hits, more imbalance); 0 ignores it. Ties go to the more cached replica, then in turn; with
nothing cached anywhere the cost is the load alone (the `least` decision). A prompt that cannot be hashed (no
tokenizer for text), or no synchronized index, goes to the least loaded by queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from router_node.kv_index import KVIndex, ReplicaFeed
from router_node.kv_load import ActiveLoad
from router_node.replica import Replica
from router_node.request import RouteRequest
from router_node.strategies import DEFAULT_TOKENS, LeastLoaded, Pick, Rotation
from scheduler_node.core.kv.block_ops import hash_block
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.router import DEFAULT_OVERLAP_WEIGHT

logger = logging.getLogger(__name__)

# 4: a block the request would compute costs four blocks of work ahead, since computing it costs more than the
# time: in a cache that holds part of the working set, each copy of a prefix on a second replica evicts a block
# another prefix will compute again. Measured (scripts/bench_kv_routing.py --smoke, 2, 3 and 4 replicas, 6 runs):
# at 4 `kv` found 0.84-0.85 of the prompt tokens cached in every run (the workload's ceiling), at 3 0.83-0.85
# (2 runs), at 2 0.69-0.84 (its home replicas gave 2-14 of 96 requests away, each copy crowding a cache), at
# Dynamo's 1 0.63-0.82; at 4 every replica got between 2/3 and 4/3 of an even share. The price is balance when
# one prefix dominates: a replica holding a 60-block prompt takes its requests until it runs about 240 blocks
# more than another (e.g. 15 more streams of 16 blocks each).
# A routed request's blocks count as held by its replica until their events come, at most this long (and not
# past a restart), so the next request of the prefix follows it while the first still computes it.
PENDING_S = 10.0


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, as the scheduler registers them."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size], salt))
    return hashes


class PromptTokens:
    """A request's prompt as token ids, tokenized like its replica's door would (None when it cannot be)."""

    def __init__(self, tokenizers: Mapping[str, ModelTokenizer]) -> None:
        self.tokenizers = tokenizers  # by model name
        self._warned: set[str] = set()

    def ids(self, request: RouteRequest, model: str) -> list[int] | None:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None:
            if model not in self._warned:
                self._warned.add(model)
                logger.warning("kv routing: no tokenizer=DIR for model %r; its text requests go by least_loaded", model)
            return None
        try:
            if request.messages:
                return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in request.messages])
            return tokenizer.encode(request.prompt)
        except Exception:  # the replica's door refuses what its template refuses; routing just cannot use it
            return None


class KVAware:
    name = "kv"

    def __init__(self, index: KVIndex, feeds: Mapping[str, ReplicaFeed], prompts: PromptTokens,
                 overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not overlap_weight >= 0:
            raise ValueError(f"--kv-overlap-weight must be >= 0, got {overlap_weight}")
        self.index = index
        self.feeds = feeds
        self.prompts = prompts
        self.overlap_weight = overlap_weight
        self.rotation = Rotation()
        self.least = LeastLoaded()
        self.clock = clock
        self.active = ActiveLoad()  # the work this router sent each replica that is not done

    def cached(
        self, request: RouteRequest, candidates: Sequence[Replica]
    ) -> tuple[dict[str, int], int, dict[str, list[bytes]], int] | None:
        """Each candidate's cached leading blocks of the request, its prompt's length in blocks (the block size of
        the synchronized replicas), its hashes per replica and its length in tokens; None when the prompt cannot be
        hashed."""
        synced = [f for r in candidates if (f := self.feeds.get(r.address)) is not None and f.synced]
        if not synced:
            return {r.address: 0 for r in candidates}, 1, {}, 0
        ids = self.prompts.ids(request, candidates[0].model)
        if ids is None:
            return None
        counts = {r.address: 0 for r in candidates}
        hashes: dict[str, list[bytes]] = {}
        prompt_blocks = 1
        now = self.clock()
        for size in {f.block_size for f in synced}:  # one, unless the replicas of a model differ
            keys = block_hashes(ids, size, request.cache_salt)
            names = [f.name for f in synced if f.block_size == size]
            counts.update(self.index.overlap(keys, names, now))
            hashes.update(dict.fromkeys(names, keys))
            prompt_blocks = max(prompt_blocks, -(-len(ids) // size))
        return counts, prompt_blocks, hashes, len(ids)

    def _routed(self, replica: Replica, keys: list[bytes]) -> None:
        """The request's blocks will be on `replica` once it computed them: count them there meanwhile."""
        now = self.clock()
        self.index.predict(replica.address, keys, now + PENDING_S, now)

    def _own_blocks(self, replica: str, hashes: Mapping[str, list[bytes]], tokens: int, prompt_blocks: int) -> int:
        """The blocks a request of `tokens` (prompt and output) holds on `replica` that no other request shares:
        its partial last prompt block and its output; all its blocks where the index is resynchronizing (their
        hashes are unknown there)."""
        if replica not in hashes:
            return prompt_blocks
        return -(-tokens // self.feeds[replica].block_size) - len(hashes[replica])

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Pick:
        found = self.cached(request, candidates)
        if found is None:
            return Pick(self.least.choose(request, candidates).replica, "untokenized")
        counts, prompt_blocks, hashes, length = found
        if not hashes:  # no replica's index is synchronized: nothing to count in blocks
            return Pick(self.least.choose(request, candidates).replica, "least")
        best_hit = max(counts.values())
        tokens = DEFAULT_TOKENS if request.max_tokens is None else request.max_tokens
        own = {r.address: self._own_blocks(r.address, hashes, length + tokens, prompt_blocks) for r in candidates}

        def cost(r: Replica) -> tuple[float, int]:
            ahead = self.active.prefill_blocks(r.address)
            active = self.active.active_blocks(r.address, hashes.get(r.address, ())) + own[r.address]
            others = r.others * prompt_blocks
            new = prompt_blocks - counts[r.address]
            return self.overlap_weight * new + (ahead + active + others) / r.weight, -counts[r.address]

        best = min(self.rotation.order(candidates), key=cost)
        keys = hashes.get(best.address, [])
        if keys:
            self._routed(best, keys)
        ticket = self.active.add(best.address, keys, prompt_blocks - counts[best.address], own[best.address])
        decision = "least" if best_hit == 0 else "overlap" if counts[best.address] == best_hit else "load"
        return Pick(best, decision, ticket)
