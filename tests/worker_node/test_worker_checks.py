"""A real worker process range-checks what a plan points at before any kernel reads the cache: a block id outside
its cache is a StepError for that plan, never a segfault, and the worker serves the next plan."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from minivllm.cluster import REPO, free_port
from proto.wire import (
    Assignment,
    Message,
    NewRequest,
    SamplingOptions,
    StepError,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
)
from tests.support.ops import TINY_WORKER, prompt_ids

pytestmark = pytest.mark.e2e


class RawScheduler:
    """A ROUTER socket standing in for the scheduler, speaking the wire directly."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = free_port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.identity = b""

    def send(self, message: Message) -> None:
        self.sock.send_multipart([self.identity, encode(message)])

    def recv(self, kind: type, timeout: float = 60.0) -> Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                identity, data = self.sock.recv_multipart()
                self.identity = identity
                message = decode(data)
                if isinstance(message, kind):
                    return message
        raise TimeoutError(f"no {kind.__name__} within {timeout} s")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_out_of_range_blocks_are_a_step_error_not_a_crash(tiny_llama_dir: Path, tmp_path: Path) -> None:
    scheduler = RawScheduler()
    log = open(tmp_path / "worker.log", "w")
    argv = [sys.executable, "-m", "worker_node.worker", "--scheduler-address", f"127.0.0.1:{scheduler.port}"]
    worker = subprocess.Popen([*argv, "--threads", "1", *TINY_WORKER], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        scheduler.recv(WorkerHello)
        scheduler.send(Assignment(0, 1, str(tiny_llama_dir), "float32", 16, 64, 8))
        ready = scheduler.recv(WorkerReady)
        assert isinstance(ready, WorkerReady)
        prompt = prompt_ids(5, 20)
        bad = ready.num_kv_blocks + 10**6
        # 19 of 20 tokens "cached" in a bad first block, the 20th written to block 0: decode attention would read the
        # bad block (the C kernel reads it without bounds checks)
        decode_step = NewRequest(1, prompt, [], SamplingOptions(temperature=0.0), [bad, 0], 19, 1)
        scheduler.send(StepPlan(1, [decode_step]))
        error = scheduler.recv(StepError)
        assert isinstance(error, StepError) and error.step_id == 1 and "block id" in error.reason, error
        for step, blocks in ((2, [-1]), (3, [0, 1])):
            negative = StepPlan(
                step, [NewRequest(step, prompt, [], SamplingOptions(0.0), blocks, 0, 20 if step == 3 else 1)]
            )
            if step == 3:  # swap pairs are checked as well
                negative.swap_in = [(10**6, 0)]
            scheduler.send(negative)
            assert isinstance(scheduler.recv(StepError), StepError)
        good = NewRequest(4, prompt, [], SamplingOptions(temperature=0.0), [0, 1], 0, len(prompt))
        scheduler.send(StepPlan(4, [good]))
        result = scheduler.recv(StepResult)
        assert isinstance(result, StepResult) and len(result.tokens_of(4) or []) == 1
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()
        scheduler.close()
        log.close()
