"""A consistent-hash ring: each replica owns many points (in proportion to its weight), a key goes to the owner of
the first point at or after its hash. When a replica leaves, only the keys it owned move (to their next owner);
when it comes back, they return to it."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence
from typing import Generic, Protocol, TypeVar

POINTS_PER_WEIGHT = 160  # enough points that each replica's share of the keys is within a few % of its weight


class Member(Protocol):
    @property
    def address(self) -> str: ...

    @property
    def weight(self) -> float: ...


M = TypeVar("M", bound=Member)


def position(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


class HashRing(Generic[M]):
    def __init__(self, members: Sequence[M]) -> None:
        points: list[tuple[int, int]] = []
        for index, m in enumerate(members):
            for i in range(max(1, round(POINTS_PER_WEIGHT * m.weight))):
                points.append((position(f"{m.address}#{i}".encode()), index))
        points.sort()
        self._hashes = [h for h, _ in points]
        self._owners = [i for _, i in points]
        self.members = list(members)

    def walk(self, key: bytes) -> Iterator[M]:
        """Every member once, in the order the ring meets them clockwise from the key's position."""
        if not self.members:
            return
        start = bisect.bisect_left(self._hashes, position(key))
        seen: set[int] = set()
        n = len(self._hashes)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield self.members[owner]
                if len(seen) == len(self.members):
                    return
