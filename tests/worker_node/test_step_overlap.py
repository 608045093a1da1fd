"""Overlapped steps (worker_node/step_overlap.py): the next plan launched before a step's tokens reach the host,
its decodes reading them on the device. On by default only on CUDA, so here it is switched on (`overlap_steps="on"`)
on the CPU, where the same code runs with the device being the CPU: the tokens must be the ones of steps run one
after the other, for every kind of row in one batch (greedy, seeded draws, penalties and logprobs that make a step
finish at once), through preemption, rows given to new requests while a token is in flight, and both transports.
The step thread's order of replies and the batch's placeholders are tested on their own."""

from __future__ import annotations

import queue
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams, TokensPrompt
from proto.wire import CachedRequest, Message, NewRequest, SamplingOptions, StepError, StepPlan, StepResult
from tests.support.models import assert_teacher_forced, load_hf
from worker_node.input_batch import InputBatch
from worker_node.plan_loop import StepThread
from worker_node.step_overlap import Launched, may_follow, overlaps_on

VOCAB = 49152


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 15, 16, 17, 33, 48, 70, 9, 26)]
    params = []
    for i in range(len(prompts)):
        m = 8 + 4 * i
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        elif i % 3 == 1:  # drawn on the device too
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=m, ignore_eos=True, n=2))
        else:  # a processor and logprobs: steps with this row are finished before the next is launched
            params.append(
                SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2, max_tokens=m, ignore_eos=True)
            )
    return prompts, params


def _generate(folder: Path, overlap: str, backend: str, **engine: object) -> tuple[list[list[list[int]]], int, int]:
    prompts, params = _workload(11)
    with LLM(str(folder), dtype="float32", overlap_steps=overlap, worker_backend=backend, threads=1, **engine) as llm:  # type: ignore[arg-type]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        overlapped = llm.engine.workers.runners[0].overlapped if backend == "inprocess" else -1  # type: ignore[attr-defined]
        preemptions = llm.engine.scheduler.num_preemptions
    return [[c.token_ids for c in o.outputs] for o in outputs], overlapped, preemptions


@pytest.mark.model
def test_overlapped_steps_give_the_tokens_of_steps_run_in_turn(tiny_llama_dir: Path) -> None:
    # Few KV blocks (preemption), small chunks (chunked prefill), 3 rows (rows reused while tokens are in flight).
    engine = {"num_kv_blocks": 14, "max_num_batched_tokens": 24, "max_num_seqs": 3}
    sequential, none, _ = _generate(tiny_llama_dir, "off", "inprocess", **engine)
    overlapped, count, preemptions = _generate(tiny_llama_dir, "on", "inprocess", **engine)
    assert none == 0, "off means off"
    assert count > 20, f"the test lost its point: {count} steps overlapped"
    assert preemptions > 0, "the test lost its point: no preemption"
    assert overlapped == sequential
    prompts, params = _workload(11)
    hf = load_hf(tiny_llama_dir)
    for prompt, p, outs in zip(prompts, params, overlapped):
        if p.temperature == 0 and p.repetition_penalty == 1.0:
            assert_teacher_forced(hf, prompt, outs[0])


@pytest.mark.e2e
def test_a_worker_process_overlaps_when_told(tiny_llama_dir: Path) -> None:
    """`--overlap-steps on` reaches a vllm-worker process (worker_argv) and its plan loop; the same tokens."""
    sequential, _, _ = _generate(tiny_llama_dir, "off", "inprocess", kv_cache_memory="8MiB")
    overlapped, _, _ = _generate(tiny_llama_dir, "on", "processes", kv_cache_memory="8MiB")
    assert overlapped == sequential


@pytest.mark.unit
def test_the_choice_and_its_errors() -> None:
    assert overlaps_on("auto", torch.device("cuda", 0)) and not overlaps_on("auto", torch.device("cpu"))
    assert overlaps_on("on", torch.device("cpu")) and not overlaps_on("off", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="overlap_steps"):
        overlaps_on("sometimes", torch.device("cpu"))
    with pytest.raises(ValueError, match="overlap_steps must be one of auto, on, off, got 'yes'"):
        LLM("unused", overlap_steps="yes")
    assert may_follow(StepPlan(1)) and not may_follow(StepPlan(1, propose=[3]))
    assert not may_follow(StepPlan(1, cached_requests=[CachedRequest(3, 5, 2, draft_token_ids=(7,))]))


class Recorder:
    """A runner whose plans overlap when their step id is even; plan 7 fails to launch."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def launch(self, plan: StepPlan) -> Launched:
        self.log.append(f"launch {plan.step_id}")
        if plan.step_id == 7:
            raise ValueError("a bad plan")
        step_id = plan.step_id

        def finish() -> StepResult:
            self.log.append(f"finish {step_id}")
            return StepResult(step_id, {})

        return Launched(step_id, finish, overlaps=step_id % 2 == 0)

    def execute(self, plan: StepPlan) -> Message:
        raise AssertionError("an overlapping step thread launches")


@pytest.mark.unit
def test_the_step_thread_answers_in_order_and_finishes_behind_the_next_launch() -> None:
    runner = Recorder()
    replies: queue.Queue[Message] = queue.Queue()
    thread = StepThread(0, runner.execute, replies.put, overlap=runner)
    for step_id in (2, 4, 5, 6, 7, 8):  # all queued before the thread starts: each finds the next one waiting
        thread.inbox.put(StepPlan(step_id, propose=[1] if step_id == 5 else []))  # 5 asks the draft model
    thread.start()
    answers = [replies.get(timeout=10) for _ in range(6)]
    assert [a.step_id for a in answers] == [2, 4, 5, 6, 7, 8], "one reply per plan, in order"  # type: ignore[attr-defined]
    assert isinstance(answers[4], StepError) and "a bad plan" in answers[4].reason
    assert runner.log == [
        "launch 2",
        "launch 4",  # 2's tokens are read behind 4's launch
        "finish 2",
        "finish 4",  # 5 may not follow 4: 4 is finished first
        "launch 5",
        "finish 5",  # 5 does not overlap
        "launch 6",
        "launch 7",  # fails: 6 is answered before 7's error
        "finish 6",
        "launch 8",
        "finish 8",  # nothing waits behind it: finished at once
    ]
    thread.stop()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.unit
def test_placeholders_are_read_on_the_device_and_filled_only_where_the_request_is_still_held() -> None:
    batch = InputBatch(block_size=4, device=torch.device("cpu"), rows=2)
    greedy = SamplingOptions(temperature=0.0)
    a = batch.add(NewRequest(1, [5, 6, 7], [], greedy, [0, 3], 0, 3))
    b = batch.add(NewRequest(2, [8, 9], [], greedy, [1], 0, 2))
    rows = np.array([a.row, b.row])
    step = batch.gather(rows, np.array([3, 2]), 0)  # both prompts: both sample
    sampled = torch.tensor([40, 41])
    places = batch.reserve(step, sampled)
    assert a.token_ids == [5, 6, 7, -1] and b.token_ids == [8, 9, -2]
    nxt = batch.gather(rows, np.array([1, 1]), 0)  # their decodes read the tokens where they were sampled
    assert nxt.input_ids.tolist() == [40, 41] and nxt.positions.tolist() == [3, 2]
    batch.remove(2)  # finished by the next plan; its row goes to another request
    c = batch.add(NewRequest(3, [1, 2, 3], [], greedy, [2], 0, 3))
    assert c.row == b.row
    batch.fill(places, [40, 41], sampled)
    assert a.token_ids == [5, 6, 7, 40] and batch.rows.token_ids[a.row, 3] == 40
    untouched = c.token_ids == [1, 2, 3] and batch.rows.token_ids[c.row, :3].tolist() == [1, 2, 3]
    assert untouched, "the new request untouched"
    assert batch.rows.in_flight is None
    batch.append_tokens(a, [-1])  # a placeholder that no launched step stands behind
    with pytest.raises(RuntimeError, match="no launched step"):
        batch.gather(np.array([a.row]), np.array([1]), 0)
