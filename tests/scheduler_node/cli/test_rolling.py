"""vllm-serve's rolling restart as a state machine over a stand-in fleet: one replica at a time, drained with
migrate, replaced, back in the routing before the next; SIGTERM when the drain fails or leaves requests, or the
replica does not exit; the round ends at a replica that does not come back, or when vllm-serve stops."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from proto import serving_pb2 as pb
from scheduler_node.cli.rolling import Deadlines, RollingRestart
from scheduler_node.cli.serve import build_parser, replica_argv, replica_plans
from scheduler_node.cli.supervisor import _roll, _router_address

pytestmark = pytest.mark.unit

QUICK = Deadlines(exit_s=0.05, stop_s=0.05, back_s=0.05)


class Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


class StandInFleet:
    """Replicas whose scheduler vllm-serve replaces (a new pid) once it exits: after a drained Drain (unless
    `stays`), or a SIGTERM (unless `stuck`); `back` says whether each is routed again once replaced."""

    def __init__(self, count: int = 2) -> None:
        self.pids = [100 + i for i in range(count)]
        self.answers = [pb.DrainResponse(drained=True, migrated=3) for _ in range(count)]
        self.failing: set[int] = set()  # their Drain fails
        self.stays: set[int] = set()  # they do not exit after a drained Drain
        self.stuck: set[int] = set()  # nor after SIGTERM
        self.back = [True] * count
        self.calls: list[tuple[str, int]] = []

    def size(self) -> int:
        return len(self.pids)

    def name(self, index: int) -> str:
        return f"replica {index}"

    def pid(self, index: int) -> int:
        return self.pids[index]

    def drain(self, index: int) -> pb.DrainResponse:
        self.calls.append(("drain", index))
        if index in self.failing:
            raise Unreachable()
        if self.answers[index].drained and index not in self.stays:
            self.pids[index] += 1000
        return self.answers[index]

    def stop(self, index: int) -> None:
        self.calls.append(("stop", index))
        if index not in self.stuck:
            self.pids[index] += 1000

    def routed(self, index: int) -> bool:
        self.calls.append(("routed", index))
        return self.back[index] and self.pids[index] > 1000


def roll(fleet: StandInFleet, cancelled: threading.Event | None = None) -> int:
    return RollingRestart(fleet, QUICK, cancelled or threading.Event(), poll_s=0.001).run()


def test_each_replica_in_turn_is_drained_replaced_and_routed_again_before_the_next() -> None:
    fleet = StandInFleet(3)
    assert roll(fleet) == 3
    assert fleet.calls == [("drain", 0), ("routed", 0), ("drain", 1), ("routed", 1), ("drain", 2), ("routed", 2)]
    assert fleet.pids == [1100, 1101, 1102]


def test_a_drain_that_leaves_requests_running_or_fails_ends_with_sigterm() -> None:
    fleet = StandInFleet()
    fleet.answers[0] = pb.DrainResponse(drained=False, remaining=2)
    fleet.failing.add(1)
    assert roll(fleet) == 2
    assert fleet.calls == [("drain", 0), ("stop", 0), ("routed", 0), ("drain", 1), ("stop", 1), ("routed", 1)]


def test_a_replica_still_running_after_its_drain_gets_sigterm() -> None:
    fleet = StandInFleet()
    fleet.stays.add(0)
    assert roll(fleet) == 2
    assert fleet.calls[:3] == [("drain", 0), ("stop", 0), ("routed", 0)]


def test_the_round_stops_at_a_replica_that_does_not_come_back_or_does_not_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = StandInFleet()
    fleet.back[0] = False
    with caplog.at_level(logging.ERROR, "vllm-serve"):
        assert roll(fleet) == 0
    assert ("drain", 1) not in fleet.calls, "never two replicas out at once"
    assert "not serving" in caplog.text and "stopped after 0 of 2" in caplog.text
    fleet = StandInFleet()
    fleet.stays.add(1)
    fleet.stuck.add(1)
    assert roll(fleet) == 1
    assert fleet.calls[-2:] == [("drain", 1), ("stop", 1)]


def test_vllm_serve_stopping_ends_the_round() -> None:
    cancelled = threading.Event()
    fleet = StandInFleet()
    fleet.back[0] = False

    def stopping(index: int) -> bool:  # vllm-serve got SIGTERM while the replica comes back
        cancelled.set()
        return False

    fleet.routed = stopping  # type: ignore[method-assign]
    rolling = RollingRestart(fleet, Deadlines(60, 60, 60), cancelled, poll_s=0.001)
    assert rolling.run() == 0
    assert fleet.calls == [("drain", 0)]


def test_replicas_of_vllm_serve_exit_after_a_drain_and_a_single_one_ignores_sighup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = build_parser().parse_args(["--data-parallel-size", "2", "--device", "cpu"])
    plans = replica_plans(args)
    assert all("--exit-after-drain" in replica_argv(args, plan, len(plans)) for plan in plans)
    single = build_parser().parse_args(["--device", "cpu"])
    assert "--no-exit-after-drain" in replica_argv(single, replica_plans(single)[0], 1)
    with caplog.at_level(logging.WARNING, "vllm-serve"):
        assert _roll(single, replica_plans(single), [], None, threading.Event()) is None
    assert "SIGHUP ignored: a rolling restart needs --data-parallel-size >= 2" in caplog.text


def test_vllm_serve_asks_its_router_on_loopback_unless_it_serves_tls() -> None:
    args = build_parser().parse_args(["--host", "0.0.0.0", "--grpc-port", "7000"])
    assert _router_address(args) == "127.0.0.1:7000"
    args.host = "::1"
    assert _router_address(args) == "[::1]:7000"
    args.tls_cert = "cert.pem"
    assert _router_address(args) is None
