"""A collective that fails because a peer rank died is WorldBroken, and a worker whose step meets it leaves (exit
status EXIT_WORLD_BROKEN) so the scheduler restarts the whole world, instead of answering a StepError that ends
the step's requests with INTERNAL while the world stays half-broken."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from minivllm.cluster import REPO, free_port
from proto.parallel import ParallelLayout
from worker_node.parallel import ParallelRank, WorldBroken, connect
from worker_node.plan_loop import EXIT_WORLD_BROKEN

pytestmark = pytest.mark.e2e

PEER = """
import os, sys, torch
from proto.parallel import ParallelLayout
from worker_node.parallel import ParallelRank, connect
comm = connect(ParallelRank(ParallelLayout(2, 1), 1), sys.argv[1], "127.0.0.1", torch.device("cpu"), 30.0)
comm.all_reduce(torch.ones(4))
os._exit(0)
"""  # joins as TP rank 1, takes part in one all-reduce, and exits without a word (no process-group teardown: a
# normal exit may abort in gloo's destructor while rank 0 still holds the pair open)


def test_a_collective_with_a_dead_peer_is_world_broken() -> None:
    address = f"127.0.0.1:{free_port()}"
    peer = subprocess.Popen([sys.executable, "-c", PEER, address], cwd=REPO)
    comm = connect(ParallelRank(ParallelLayout(2, 1), 0), address, "127.0.0.1", torch.device("cpu"), 30.0)
    try:
        assert comm.all_reduce(torch.ones(4)).tolist() == [2.0] * 4
        assert peer.wait(30) == 0
        with pytest.raises(WorldBroken):
            comm.all_reduce(torch.ones(4))
    finally:
        comm.close()
        peer.kill()


def test_a_worker_whose_step_breaks_the_world_exits_for_a_restart() -> None:
    code = textwrap.dedent("""
        from proto.wire import StepPlan
        from worker_node.parallel import WorldBroken
        from worker_node.plan_loop import StepThread

        def execute(plan):
            raise WorldBroken("Connection closed by peer")

        thread = StepThread(1, execute, deliver=lambda reply: print("answered", reply))
        thread.start()
        thread.inbox.put(StepPlan(7))
        thread.join(30)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == EXIT_WORLD_BROKEN, run.stdout + run.stderr
    assert "answered" not in run.stdout and "a collective failed" in run.stderr
