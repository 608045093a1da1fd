"""engine/ports.py: a port handed out once is not handed out again, though the kernel offers it again."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from scheduler_node.engine import ports
from scheduler_node.engine.ports import free_port

pytestmark = pytest.mark.unit


class _Probe:
    """A socket whose port 0 binds to the next of a fixed sequence, as a kernel that offers one port twice."""

    offers: Iterator[int]

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = next(self.offers)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_offers_twice_is_handed_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _Probe.offers = iter([61001, 61001, 61001, 61002])
    monkeypatch.setattr(ports.socket, "socket", _Probe)
    monkeypatch.setattr(ports, "_handed_out", set())
    assert [free_port(), free_port()] == [61001, 61002]


def test_free_ports_are_distinct_and_bindable() -> None:
    taken = [free_port() for _ in range(200)]
    assert len(set(taken)) == len(taken)
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken[-1]))
