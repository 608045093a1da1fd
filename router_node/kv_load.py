"""The `kv` strategy's load term: the work the router sent each replica that is not done, in KV blocks.

After NVIDIA Dynamo's router ("active sequences"), per replica, over the requests this router routed there and
that have not ended:

- prefill blocks: the prompt blocks each must compute (those not cached when it was routed), until its first token
  comes back (then its prompt is computed);
- active blocks: the KV blocks they hold (their prompts' full blocks, each distinct block once: requests that share
  a prefix share its blocks on the replica), plus each one's own partial last block and output blocks.

A request ahead that is a cache hit adds few prefill blocks, so a tenant's home replica is not made to look busy
by the cheap hits it serves; one that computes a long prompt adds all of it. Each routed request gets a `Ticket`
that the forwarding code ends when its stream closes (and marks prefilled at its first token).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Ticket:
    """One routed request's share of its replica's load, from routing until its stream closes."""

    load: ActiveLoad
    replica: str
    hashes: Sequence[bytes]  # its prompt's full blocks
    prefill: int  # prompt blocks it computes there (not cached when routed)
    private: int  # blocks only it holds: its partial last prompt block and its output
    prefilling: bool = True
    ended: bool = False

    def prefilled(self) -> None:
        """Its first token came back: its prompt is computed (idempotent)."""
        if self.prefilling and not self.ended:
            self.prefilling = False
            self.load.prefill[self.replica] -= self.prefill

    def end(self) -> None:
        """Its stream closed: it holds nothing on the replica any more (idempotent)."""
        if self.ended:
            return
        self.prefilled()
        self.ended = True
        self.load.private[self.replica] -= self.private
        held = self.load.held[self.replica]
        held.subtract(self.hashes)
        for h in self.hashes:
            if held[h] <= 0:
                del held[h]


@dataclass(slots=True)
class ActiveLoad:
    prefill: Counter[str] = field(default_factory=Counter)  # replica -> prompt blocks still to compute
    private: Counter[str] = field(default_factory=Counter)  # replica -> blocks held by one request each
    held: dict[str, Counter[bytes]] = field(default_factory=dict)  # replica -> {block hash: requests holding it}

    def add(self, replica: str, hashes: Sequence[bytes], prefill: int, private: int) -> Ticket:
        """A request routed to `replica` now: counted until its ticket ends."""
        self.prefill[replica] += prefill
        self.private[replica] += private
        self.held.setdefault(replica, Counter()).update(hashes)
        return Ticket(self, replica, hashes, prefill, private)

    def prefill_blocks(self, replica: str) -> int:
        return self.prefill[replica]

    def active_blocks(self, replica: str, hashes: Sequence[bytes] = ()) -> int:
        """The blocks the replica's requests hold, with a new request's `hashes` among them (those already held
        count once)."""
        held = self.held.get(replica, Counter())
        return len(held) + sum(1 for h in set(hashes) if h not in held) + self.private[replica]
