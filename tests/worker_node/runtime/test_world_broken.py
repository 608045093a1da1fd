"""A collective that fails because a peer rank died is WorldBroken, and a worker whose step meets it leaves (exit
status EXIT_WORLD_BROKEN) so the scheduler restarts the whole world, instead of answering a StepError that ends
the step's requests with INTERNAL while the world stays half-broken; and a worker that must leave while its step
waits in a collective for a peer cut off by the network exits at once instead of when gloo gives up."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import zmq

from minivllm.cluster import REPO, free_port
from proto.parallel import ParallelLayout
from proto.wire import Heartbeat, Shutdown, StepPlan, decode, encode
from worker_node.plan_loop import EXIT_WORLD_BROKEN
from worker_node.runtime.parallel import ParallelRank, WorldBroken, connect

pytestmark = pytest.mark.e2e

PEER = """
import os, sys, torch
from proto.parallel import ParallelLayout
from worker_node.runtime.parallel import ParallelRank, connect
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


@pytest.mark.parametrize(("scheduler_lost", "status"), [(False, EXIT_WORLD_BROKEN), (True, 0)])
def test_a_worker_whose_step_breaks_the_world_exits_for_a_restart(scheduler_lost: bool, status: int) -> None:
    """With the scheduler's link down, the broken collective is the scheduler's death seen through peers that gave
    up on it first: this rank leaves cleanly like them (a restart status would say the world broke)."""
    code = textwrap.dedent(f"""
        from proto.wire import StepPlan
        from worker_node.runtime.parallel import WorldBroken
        from worker_node.plan_loop import StepThread

        def execute(plan):
            raise WorldBroken("Connection closed by peer")

        thread = StepThread(1, execute, lambda reply: print("answered", reply), scheduler_lost=lambda: {scheduler_lost})
        thread.start()
        thread.inbox.put(StepPlan(7))
        thread.join(30)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == status, run.stdout + run.stderr
    assert "answered" not in run.stdout and "a collective failed" in run.stderr


STOPPED_PEER = """
import os, signal, sys, torch
from proto.parallel import ParallelLayout
from worker_node.runtime.parallel import ParallelRank, connect
comm = connect(ParallelRank(ParallelLayout(2, 1), 1), sys.argv[1], "127.0.0.1", torch.device("cpu"), 300.0)
comm.all_reduce(torch.ones(4))
os.kill(os.getpid(), signal.SIGSTOP)
"""  # joins as TP rank 1, takes part in one all-reduce, then falls silent with its connections open: to its peer,
# a host cut off by the network

LEAVING_WORKER = """
import sys, torch, zmq
from proto.parallel import ParallelLayout
from worker_node.runtime.parallel import ParallelRank, connect
from worker_node.plan_loop import PlanLoop
comm = connect(ParallelRank(ParallelLayout(2, 1), 0), sys.argv[1], "127.0.0.1", torch.device("cpu"), 300.0)
comm.all_reduce(torch.ones(4))
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[2])

def execute(plan):
    comm.all_reduce(torch.ones(4))  # the peer is stopped: this waits out the 300 s timeout
    raise AssertionError("the all-reduce returned")

code = PlanLoop(sock, 0, execute, 30.0).run()
comm.close()
sys.exit(code)
"""  # rank 0 as vllm-worker runs it: the plan loop on a socket, a step that all-reduces


def test_a_worker_told_to_leave_mid_collective_exits_at_once() -> None:
    """A partition: the scheduler declares the cut-off rank lost and tells the other to leave, which is blocked in
    an all-reduce with it. It must exit at once (its supervisor starts a replacement), not when gloo gives up."""
    rendezvous = f"127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = subprocess.Popen([sys.executable, "-c", STOPPED_PEER, rendezvous], cwd=REPO)
    worker = subprocess.Popen([sys.executable, "-c", LEAVING_WORKER, rendezvous, f"tcp://127.0.0.1:{port}"], cwd=REPO)
    try:
        assert router.poll(60_000), "the worker's first heartbeat"
        identity, data = router.recv_multipart()
        assert isinstance(decode(data), Heartbeat)
        router.send_multipart([identity, encode(StepPlan(1))])
        router.send_multipart([identity, encode(Shutdown("declared lost: rank 1 was lost; every rank restarts"))])
        assert worker.wait(15) == 0
    finally:
        for p in (worker, peer):
            p.kill()
            p.wait()
        ctx.destroy(linger=0)
