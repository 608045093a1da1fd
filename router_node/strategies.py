"""How the router picks one replica among the serving replicas of the request's model.

- `round_robin`: smooth weighted round robin (each replica's share follows its weight, picks interleave).
- `least_loaded`: the fewest requests ahead (the replica's polled queue, or the router's open streams on it when
  those are more) per unit of weight; ties go to the lower KV usage, then in turn.
- `prefix`: the prompt's first characters hashed onto a consistent-hash ring of the replicas, so requests that
  share a system prompt land where its KV blocks are cached. A load cap (consistent hashing with bounded loads,
  Mirrokni et al. 2018) keeps a hot prefix from swamping one replica: a replica takes the request only while its
  open streams stay within `load_factor` x its weighted share of all open streams, else the ring's next one does.
- `latency`: the lowest expected finish time (EWMA of measured time to first token + EWMA time per output token x
  the request's max_tokens), times the replica's open streams + 1 so a burst spreads instead of piling onto the
  replica that was fastest a moment ago (Finagle's "peak EWMA" cost). Unmeasured replicas count as average.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router_node.kv_load import Ticket
from router_node.replica import Replica
from router_node.request import RouteRequest
from router_node.ring import HashRing

STRATEGIES = ("round_robin", "least_loaded", "prefix", "latency", "kv")  # kv: router_node/kv_strategy.py
DEFAULT_TOKENS = 64  # `latency`: output tokens expected of a request that does not say (no max_tokens)
MAX_RINGS = 64  # `prefix`: rings kept, one per set of candidates (a retry excludes one replica)


@dataclass(frozen=True, slots=True)
class Pick:
    replica: Replica
    decision: str  # why, for the routing-decisions metric: "next", "least", "affinity", "overflow", ...
    ticket: Ticket | None = None  # `kv`: the request's share of the replica's load, ended when its stream closes


class Strategy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Pick:
        """One of `candidates` (never empty: serving replicas of one model)."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Pick:
        total = sum(r.weight for r in candidates)
        for r in candidates:
            self.current[r.address] = self.current.get(r.address, 0.0) + r.weight
        best = max(candidates, key=lambda r: self.current[r.address])
        self.current[best.address] -= total
        return Pick(best, "next")


class Rotation:
    """Candidates in an order that moves on by one each call, so `min` breaks ties in turn."""

    def __init__(self) -> None:
        self.turn = 0

    def order(self, candidates: Sequence[Replica]) -> list[Replica]:
        self.turn += 1
        start = self.turn % len(candidates)
        return [*candidates[start:], *candidates[:start]]


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Pick:
        best = min(self.rotation.order(candidates), key=lambda r: (r.queue / r.weight, r.load.kv_usage))
        return Pick(best, "least")


class PrefixAffinity:
    name = "prefix"

    def __init__(self, chars: int, load_factor: float) -> None:
        if chars < 1:
            raise ValueError(f"--routing-prefix-chars must be >= 1, got {chars}")
        if not load_factor >= 1:
            raise ValueError(f"--routing-load-factor must be >= 1 (1: strict balance), got {load_factor}")
        self.chars = chars
        self.load_factor = load_factor
        self.rings: dict[tuple[str, ...], HashRing[Replica]] = {}

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Pick:
        open_streams = sum(r.in_flight for r in candidates)
        total_weight = sum(r.weight for r in candidates)
        for i, r in enumerate(self._ring(candidates).walk(request.prefix_key(self.chars))):
            cap = math.ceil(self.load_factor * (open_streams + 1) * r.weight / total_weight)
            if r.in_flight + 1 <= cap:
                return Pick(r, "affinity" if i == 0 else "overflow")
        raise AssertionError("the caps add up to more than the open streams: some replica is under its cap")

    def _ring(self, candidates: Sequence[Replica]) -> HashRing[Replica]:
        key = tuple(r.address for r in candidates)
        ring = self.rings.get(key)
        if ring is None or ring.members != list(candidates):
            if len(self.rings) >= MAX_RINGS:
                self.rings.clear()
            ring = self.rings[key] = HashRing(candidates)
        return ring


class Latency:
    name = "latency"

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Pick:
        tokens = DEFAULT_TOKENS if request.max_tokens is None else request.max_tokens
        measured = [expected for r in candidates if (expected := _expected_seconds(r, tokens)) is not None]
        typical = sum(measured) / len(measured) if measured else 1.0

        def cost(r: Replica) -> float:
            expected = _expected_seconds(r, tokens)
            return (typical if expected is None else expected) * (r.in_flight + 1) / r.weight

        best = min(self.rotation.order(candidates), key=cost)
        return Pick(best, "explore" if best.ttft_ewma is None else "ewma")


def _expected_seconds(r: Replica, tokens: int) -> float | None:
    if r.ttft_ewma is None:
        return None
    return r.ttft_ewma + (r.tpot_ewma or 0.0) * max(0, tokens - 1)


def make_strategy(name: str, prefix_chars: int, prefix_load_factor: float) -> Strategy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAffinity(prefix_chars, prefix_load_factor)
    if name == "latency":
        return Latency()
    if name == "kv":
        raise ValueError("--routing-strategy kv needs the replicas' KV events: the router builds it (Router(kv=...))")
    raise ValueError(f"--routing-strategy must be one of {', '.join(STRATEGIES)} or module:function, got {name!r}")
