"""Chaos, as a user meets it: `vllm-serve` with its default flags (ports apart) under a mixed load of streaming
requests (greedy and seeded, n > 1, shared prefixes, some cancelled by their clients), while workers are killed,
stalled past the heartbeat timeout, or one rank of a TP 2 x PP 2 world dies. Every request that was not cancelled
completes with its full token count (greedy ones are HF's argmax at every position); none takes longer than BOUND;
at idle every block is free and no request is left."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from clients.bench.mixed import Load, Outcome, mixed_requests
from minivllm.cluster import ServeProcess as Serve
from proto import serving_pb2 as pb
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.ops import wait_for

# The tiny random models run in float32, where a recompute after a loss must give HF's argmax to 1e-3: in bf16
# (this CPU's default) their near-flat distributions over hundreds of tokens part from HF's at rounding-sized gaps
# (measured up to 0.08), which would hide a recovery bug as well as fail without one. The SmolLM2 test keeps every
# default, bf16 included, on text prompts against HF in float32, with a tolerance from bf16's precision rather than
# the standards' 0.05: logits of up to ~30 rounded to bf16's 8 significant bits are off by up to ~0.12 each, so two
# of them by ~0.25. Without any kill our bf16 outputs of these prompts are already up to 0.058 below HF float32's
# best (0.062 below HF bf16's), and a recompute runs the prefill kernels over what decode computed before (0.107
# seen). A recovery bug (a wrong or missing KV entry after the recompute) shows as gaps of whole logprobs.
TINY = ("--dtype", "float32")
BF16_TOLERANCE = 0.25

BOUND = 300.0  # seconds a request may take at most: loss, detection, a replacement's start, recompute
REJOIN = 180.0  # seconds to wait for a replacement to be ready (a fresh worker loads the model, builds kernels)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def check(outcomes: list[Outcome], hf, tolerance: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    completed = 0
    for o in outcomes:
        rid = o.request.request_id
        assert o.code != "DEADLINE_EXCEEDED", f"{rid} hung past {BOUND} s"
        if o.cancel_after and o.code:
            assert o.code == "CANCELLED", (rid, o.code, o.details)
            continue
        assert not o.code, f"{rid} failed: {o.code} {o.details}"
        want = o.request.sampling.max_tokens
        assert sorted(o.tokens) == list(range(o.n)), (rid, sorted(o.tokens))
        for index, tokens in o.tokens.items():
            assert (len(tokens), o.finish[index]) == (want, "length"), (rid, index, len(tokens), o.finish)
        if o.greedy:
            for tokens in o.tokens.values():  # each sibling on its own: after a recompute they may part at near-ties
                assert_teacher_forced(hf, o.prompt, tokens, tolerance)
        completed += 1
    assert completed >= len(outcomes) // 2, "most requests were cancelled: the test lost its point"


def check_idle(serve: Serve) -> None:
    def idle() -> bool:
        s = serve.stats()
        return s.num_running == 0 and s.num_waiting == 0 and s.free_blocks == s.total_blocks

    wait_for(idle, 30, "the server is idle with every block free")


def replaced(serve: Serve, old: set[int], count: int) -> None:
    """Until `count` ranks are ready again, none of them one of the `old` processes."""

    def ready() -> bool:
        pids = set(serve.ready_pids())
        return len(pids) == count and not pids & old

    wait_for(ready, REJOIN, f"{count} replacement rank(s) ready", interval=0.2)


def test_kill_9_three_times_and_a_stall(tiny_llama_dir: Path, tmp_path: Path) -> None:
    serve = Serve(tiny_llama_dir, tmp_path, *TINY)
    try:
        serve.wait_serving()
        outcomes = mixed_requests(random.Random(1), 20, (200, 500))
        load = Load(serve.stub, outcomes, BOUND, spread=4.0)
        for _ in range(3):  # kill -9, each time after the previous replacement rejoined and made progress
            wait_for(load.progress(40), 60, "the load makes progress")
            (pid,) = serve.ready_pids()
            os.kill(pid, signal.SIGKILL)
            replaced(serve, {pid}, 1)
        wait_for(load.progress(40), 60, "the load makes progress")
        (pid,) = serve.ready_pids()
        os.kill(pid, signal.SIGSTOP)  # alive and connected, but silent past the heartbeat timeout (10 s)
        replaced(serve, {pid}, 1)  # never woken: vllm-serve kills the stalled worker and starts another
        check(load.join(BOUND + 10), load_hf(tiny_llama_dir, torch.float32))
        check_idle(serve)
        log = serve.log.read_text()
        assert log.count("rank 0 ready:") == 5, "each loss needs exactly one rejoin"
        assert "turning away" not in log
    finally:
        assert serve.stop() == 0, serve.tail()


def test_one_rank_of_a_tp2_pp2_world_dies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    serve = Serve(tiny_llama_dir, tmp_path, *TINY, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    try:
        serve.wait_serving()
        outcomes = mixed_requests(random.Random(2), 16, (150, 300))
        load = Load(serve.stub, outcomes, BOUND, spread=2.0)
        wait_for(lambda: load.tokens_so_far() > 60, 120, "the load makes progress")
        old = set(serve.ready_pids())
        victim = next(w.pid for w in serve.workers() if w.rank == 3)  # TP rank 1 of the last stage
        os.kill(victim, signal.SIGKILL)
        replaced(serve, old, 4)  # a torch.distributed world cannot take a new member: all four restart
        check(load.join(BOUND + 10), load_hf(tiny_llama_dir, torch.float32))
        check_idle(serve)
        assert "turning away" not in serve.log.read_text()
    finally:
        assert serve.stop() == 0, serve.tail()


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived",
    "List three colours:",
    "Explain in one paragraph why the sky is blue.",
    "Write a haiku about the sea.",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# a function that normalises the rows of a matrix\n",
]


def text_requests(folder: Path, max_tokens: int) -> list[Outcome]:
    """Greedy requests on plain text prompts, as a user would send them."""
    tok = ModelTokenizer(folder)
    out = []
    for i, text in enumerate(TEXTS):
        prompt = tok.encode(text)
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling, request_id=f"t{i}")
        out.append(Outcome(prompt, request))
    return out


def test_default_flags_kill_9_every_stream_completes_on_the_first_replacement(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """The issue's scenario with the default model and every default: 8 greedy streams, kill -9 of the worker."""
    serve = Serve(smollm2_dir, tmp_path)
    try:
        serve.wait_serving()
        outcomes = text_requests(smollm2_dir, 64)
        load = Load(serve.stub, outcomes, BOUND)
        wait_for(lambda: all(o.tokens for o in outcomes), 120, "every stream has tokens")
        (pid,) = serve.ready_pids()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        check(load.join(BOUND + 10), load_hf(smollm2_dir, torch.float32), BF16_TOLERANCE)
        assert len(outcomes) == 8
        log = serve.log.read_text()
        assert log.count("rank 0 ready:") == 2, "one rejoin, the first replacement fits"
        assert "turning away" not in log
        assert time.monotonic() - killed < BOUND
        check_idle(serve)
    finally:
        assert serve.stop() == 0, serve.tail()
