"""The timeouts every side shares are read from one constant: the scheduler's flags, the local launcher, the rank
registry and the offline LLM's arguments agree with proto/wire.py."""

from __future__ import annotations

import inspect

import pytest

from minivllm.llm import LLM
from proto.wire import HEARTBEAT_TIMEOUT_S, WORKER_JOIN_TIMEOUT_S
from scheduler_node.cli.scheduler import build_parser
from scheduler_node.engine.launchers import LocalLauncher
from scheduler_node.engine.rank_registry import RankRegistry

pytestmark = pytest.mark.unit


def test_join_and_heartbeat_timeouts_have_one_source() -> None:
    args = build_parser().parse_args([])
    assert (args.worker_join_timeout, args.heartbeat_timeout) == (WORKER_JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S)
    launcher = inspect.signature(LocalLauncher).parameters
    assert launcher["join_timeout"].default == WORKER_JOIN_TIMEOUT_S
    assert launcher["heartbeat_timeout"].default == HEARTBEAT_TIMEOUT_S
    assert inspect.signature(LLM).parameters["worker_join_timeout"].default == WORKER_JOIN_TIMEOUT_S
    assert RankRegistry(lambda identity, message: "", HEARTBEAT_TIMEOUT_S).join_timeout == WORKER_JOIN_TIMEOUT_S
