"""A script that uses `LLM` the way vLLM's quickstart does — no `with`, no `close()` — ends cleanly and promptly:
after its outputs, after Ctrl-C during `generate`, and after `generate` raised; in-process and with a TP 2 world of
worker processes, which must not outlive the script. Each script runs as its own interpreter, as a user's would."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from minivllm.cluster import REPO
from tests.support.ops import alive, wait_for

pytestmark = pytest.mark.e2e

# Seconds from a script's last line to its process being gone. The interpreter's own teardown (torch, the model)
# takes a few seconds on a loaded CPU; before the fix a script never ended (still alive 80 s later).
PROMPT_EXIT_S = 30.0

HEAD = """
import os, signal, sys, threading, time
from minivllm import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size={tp}, kv_cache_memory="16MiB", threads=1)
print("workers", *[p.pid for p in (llm._launcher.procs if llm._launcher else [])], flush=True)
"""

SCRIPTS = {
    "never_closed": """
(out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("tokens", len(out.outputs[0].token_ids), flush=True)
""",
    # Ctrl-C while generate runs: a real SIGINT to this process, sent once its request is live.
    "ctrl_c": """
def interrupt_when_running():
    while not llm.engine.num_live:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt_when_running, daemon=True).start()
try:
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    deadline = time.monotonic() + 30
    while llm.engine.num_live and time.monotonic() < deadline:
        time.sleep(0.01)
    print("interrupted; live", llm.engine.num_live, flush=True)
""",
    "raised": """
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
print("last line", time.time(), flush=True)
llm.generate(["ok"], [SamplingParams(), SamplingParams()], use_tqdm=False)  # ValueError, uncaught
""",
}

TAIL = """
print("last line", time.time(), flush=True)
"""


def run_script(model: Path, name: str, tp: int) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the script; returns its result and the seconds from its last line (or its traceback) to its end."""
    code = HEAD.format(model=str(model), tp=tp) + SCRIPTS[name] + TAIL
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    ended = time.time()
    lines = [line for line in run.stdout.splitlines() if line.startswith("last line ")]
    if lines:
        return run, ended - float(lines[-1].split()[-1])
    return run, 0.0


def worker_pids(run: subprocess.CompletedProcess[str]) -> list[int]:
    line = next(line for line in run.stdout.splitlines() if line.startswith("workers"))
    return [int(p) for p in line.split()[1:]]


def check_clean(run: subprocess.CompletedProcess[str], tp: int) -> None:
    assert "terminate called" not in run.stderr, run.stderr[-3000:]
    pids = worker_pids(run)
    assert len(pids) == (tp if tp > 1 else 0)
    wait_for(lambda: not any(alive(p) for p in pids), 15, "the worker processes end with the script")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_script_that_never_closes_its_llm_exits_0_promptly(tiny_llama_dir: Path, tp: int) -> None:
    run, exit_s = run_script(tiny_llama_dir, "never_closed", tp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens 4" in run.stdout
    assert exit_s < PROMPT_EXIT_S, f"{exit_s:.1f} s from the last line to the exit"
    check_clean(run, tp)


def test_ctrl_c_during_generate_aborts_it_and_the_script_exits_0(tiny_llama_dir: Path) -> None:
    run, exit_s = run_script(tiny_llama_dir, "ctrl_c", 1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "interrupted; live 0" in run.stdout, run.stdout
    assert exit_s < PROMPT_EXIT_S, f"{exit_s:.1f} s from the last line to the exit"
    check_clean(run, 1)


def test_a_script_whose_generate_raised_exits_1_promptly(tiny_llama_dir: Path) -> None:
    run, exit_s = run_script(tiny_llama_dir, "raised", 2)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "ValueError: sampling_params: 2 given for 1 prompts" in run.stderr, run.stderr[-3000:]
    assert exit_s < PROMPT_EXIT_S, f"{exit_s:.1f} s from the last line to the exit"
    check_clean(run, 2)
