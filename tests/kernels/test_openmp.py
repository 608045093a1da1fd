"""kernels/openmp.py: the OpenMP workers of a thread that is done with parallel work are let go, so the step
thread's pool is the only one (libgomp then lets its workers spin between regions instead of sleeping)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.openmp import release_thread_pool

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# In a fresh process: torch's parallel work on the main thread makes its pool (one worker beside the main thread
# at 2 threads); released, the worker exits; the next parallel region makes it again.
SCRIPT = """
import os, time, torch
from kernels.openmp import release_thread_pool
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def parallel_work():
    torch.ones(1 << 24).sum()
def settled(n):
    deadline = time.monotonic() + 10
    while threads() != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
before = threads()
parallel_work()
with_pool = threads()
released = release_thread_pool()
after = settled(before)
parallel_work()
print(before, with_pool, released, after, threads())
"""


def test_a_thread_s_openmp_workers_go_when_released_and_come_back_for_more_work() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True, cwd=REPO
    )
    before, with_pool, released, after, again = done.stdout.split()
    assert int(with_pool) == int(before) + 1, "the parallel region made one worker thread"
    assert released == "True"
    assert int(after) == int(before), "released, the worker exited"
    assert int(again) == int(with_pool), "more parallel work makes the pool again"


def test_releasing_outside_a_parallel_region_is_accepted_by_the_loaded_runtime() -> None:
    torch.ones(1 << 16).sum()  # torch loaded its OpenMP runtime; this thread may have a pool
    assert release_thread_pool() is True, "the runtime torch loaded has omp_pause_resource_all and accepted it"
    assert torch.ones(4).sum().item() == 4.0, "torch still works on this thread after its pool went"


# `LLM` releases its caller's pool before the engine thread has imported torch: the runtime is not loaded yet then,
# and must still be found once it is (a None kept from that first call left every later release a no-op, and a
# user's script that never imported torch itself decoded 16 int8 sequences at 550 tok/s instead of 900).
BEFORE_TORCH = """
import sys
from kernels.openmp import release_thread_pool
early = release_thread_pool()
assert "torch" not in sys.modules
import torch
torch.ones(1 << 20).sum()
print(early, release_thread_pool())
"""


def test_the_runtime_is_found_when_it_loads_after_a_first_release() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BEFORE_TORCH], capture_output=True, text=True, timeout=120, check=True, cwd=REPO
    )
    assert done.stdout.split() == ["False", "True"]
