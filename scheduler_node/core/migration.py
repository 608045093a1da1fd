"""Live migration's one piece of state: where a sequence stopped on one replica, so another continues it.

A replica draining with migrate=true ends each migratable sequence between steps with this state (its last delta
carries it, finish_reason "migrated"); vllm-router sends the request again, to another replica, with the states of
the sequences that were still running. The target recomputes prompt + outputs (chunked prefill and the prefix cache
make that cheap) and samples on from the same output position: greedy and seeded draws (a hash of the seed and the
position, worker_node/sampler.py) are exactly those of an undisturbed run. When the source's workers serve KV
(their exporters, worker_node/kv/transfer/exporter.py), the state also names where its KV waits under a lease
(`kv_source`, core/kv/leases.py): the target pulls those blocks instead of recomputing them, and computes only the
last token, so even in bfloat16 it reads the KV an undisturbed run reads. A pull that fails recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_node.core.kv.leases import KVSource


@dataclass(frozen=True, slots=True)
class SequenceResume:
    """One sequence of a migrated request (proto: minivllm.v1.SequenceState)."""

    index: int  # which of the request's n sequences: its seed is seed + index, its deltas carry it
    output_token_ids: list[int]  # every token it generated so far (the client has them all)
    held_text: str = ""  # decoded, not sent yet: it might begin a stop string
    pending_token_ids: list[int] | None = None  # the tail of output_token_ids whose text is an incomplete character
    prompt_tokens: int = 0  # the prompt's length where it ran (0: not known)
    cached_tokens: int = 0  # usage: of the prompt, found in the prefix cache where it first started
    kv_source: KVSource | None = None  # where its KV waits for the target to pull (None: the target recomputes)

    @property
    def started(self) -> bool:
        """It produced tokens before it moved (its usage's cached_tokens are the source's)."""
        return bool(self.output_token_ids)
