"""Speculative decoding (n-gram proposals) changes no token: greedy and seeded output is the same with speculation
on and off, over a mixed batch where some requests speculate and some opt out, and greedy output is HF's argmax; on
tiny Llama, Qwen3 and Mixtral, real SmolLM2, under TP, PP and both, and with a draft model's proposals."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from proto.wire import SamplingOptions
from settings.speculative import SpeculativeConfig
from tests.support.engine import EngineRun, load_runner
from tests.support.inprocess_tp import TensorParallelRanks
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.spec import ScriptedProposer
from tests.support.stages import stage_runners
from worker_node.model_runner import ModelRunner

pytestmark = pytest.mark.model

BLOCK = 16
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)


def copy_prompts(seed: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (so that n-gram proposals find matches), of lengths across blocks."""
    rng = random.Random(seed)
    prompts = []
    for length in (6, 15, 17, 30, 9, 40):
        phrase = [rng.randrange(3, vocab) for _ in range(length)]
        prompts.append(phrase + phrase[: length // 2] + phrase)
    return prompts


def run(
    folder: Path,
    prompts: list[list[int]],
    spec: SpeculativeConfig | None,
    reference: list[list[int]] | None = None,
    ranks: TensorParallelRanks | list[ModelRunner] | None = None,
) -> tuple[list[list[int]], EngineRun]:
    """The mixed batch (greedy, seeded; some opted out) on one runner, or on `ranks` (gloo-joined TP/PP ranks, or
    in-process pipeline stages); with a `reference`, proposals from ScriptedProposer (some wrong)."""
    if isinstance(ranks, TensorParallelRanks):
        runners, transport = ranks.runners, ranks.transport()
    else:
        runners, transport = ranks or [load_runner(folder, 48, BLOCK)], None
    with EngineRun(
        runners, tokenizer_dir=folder, max_num_batched_tokens=64, speculative=spec, transport=transport
    ) as r:
        if reference is not None:
            assert r.scheduler.speculator is not None
            r.scheduler.speculator.proposer = ScriptedProposer(
                {tuple(p): o for p, o in zip(prompts, reference)}, wrong=0.25
            )
        outs = []
        for i, p in enumerate(prompts):
            sampling = SamplingOptions(temperature=0.0) if i % 3 else SamplingOptions(temperature=0.8, seed=i, top_k=20)
            outs.append(r.add(p, 24, sampling=sampling, speculate=i % 4 != 1))
        r.run()
    return [o.output for o in outs], r


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mixtral"])
def test_speculation_changes_no_token(kind: str, request: pytest.FixtureRequest) -> None:
    fixture = request.getfixturevalue
    folder = fixture("tiny_llama_dir") if kind == "llama" else fixture("tiny_model_dir")(kind)
    prompts = copy_prompts(3, 1000)
    plain, _ = run(folder, prompts, None)
    speculated, r = run(folder, prompts, SPEC, reference=plain)
    counters = r.scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0, "the test lost its point: nothing accepted"
    assert counters.num_accepted_tokens < counters.num_draft_tokens, "the test lost its point: nothing rejected"
    assert speculated == plain
    assert r.scheduler.blocks.num_free == r.scheduler.blocks.num_blocks
    hf = load_hf(folder)
    for i, (prompt, output) in enumerate(zip(prompts, speculated)):
        if i % 3:
            assert_teacher_forced(hf, prompt, output)


def test_stop_strings_and_stop_tokens_end_a_speculated_step_where_they_occur(tiny_llama_dir: Path) -> None:
    """Proposals accepted in full bring several tokens a step: a stop string or a stop token among them ends the
    output at its own token, with the text, token ids and finish reason of a run without speculation."""
    from scheduler_node.text.tokenizer import ModelTokenizer

    folder = tiny_llama_dir
    prompts = copy_prompts(5, 1000)[:4]

    def finish(
        spec: SpeculativeConfig | None, reference: list[list[int]], stops: list[str], stop_ids: list[int]
    ) -> list[tuple[list[int], str, str]]:
        with EngineRun(load_runner(folder, 48, BLOCK), tokenizer_dir=folder, speculative=spec) as r:
            if spec is not None:
                assert r.scheduler.speculator is not None
                r.scheduler.speculator.proposer = ScriptedProposer(
                    {tuple(p): o for p, o in zip(prompts, reference)}, wrong=0.0, always_k=True
                )
            outs = [r.add(p, 24, stop=[s] if s else None) for p, s in zip(prompts[:2], stops)]
            outs += [r.add(p, 24, stop_token_ids=[t] if t else None) for p, t in zip(prompts[2:], stop_ids)]
            r.run()
        return [(o.output, o.completions[0].text, o.completions[0].finish_reason) for o in outs]

    plain = [ids for ids, _, _ in finish(None, [], ["", ""], [0, 0])]
    tok = ModelTokenizer(folder)
    # Steps bring tokens 0, 1-5, 6-10, 11-15 ...: each stop falls inside a step (unless its text occurs earlier).
    stops = [tok.decode(out[6:8]).strip()[-3:] for out in plain[:2]]
    stop_ids = [out[12] for out in plain[2:]]
    without = finish(None, plain, stops, stop_ids)
    assert all(reason == "stop" and len(ids) < 24 for ids, _, reason in without), "the test lost its point"
    assert finish(SPEC, plain, stops, stop_ids) == without


def draft_run(
    folder: Path, draft: Path, prompts: list[list[int]], mixed: bool = True, stages: int = 1
) -> tuple[list[list[int]], EngineRun]:
    """The mixed batch of `run` (or greedy requests that all speculate), proposals from the draft model `draft`
    (the worker's, TP 1, on the last of `stages` pipeline stages)."""
    spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3)
    if stages > 1:
        runners = stage_runners(folder, 48, BLOCK, stages, draft_model=draft, num_speculative_tokens=3)
    else:
        runners = [load_runner(folder, 48, BLOCK, draft_model=draft, num_speculative_tokens=3)]
    runner = runners[-1]
    assert all(r.draft is None for r in runners[:-1]), "the draft runs only where tokens are sampled"
    with EngineRun(runners, tokenizer_dir=folder, max_num_batched_tokens=64, speculative=spec) as r:
        outs = []
        for i, p in enumerate(prompts):
            seeded = SamplingOptions(temperature=0.8, seed=i, top_k=20)
            sampling = SamplingOptions(temperature=0.0) if i % 3 or not mixed else seeded
            outs.append(r.add(p, 24, sampling=sampling, speculate=i % 4 != 1 or not mixed))
        r.run()
    assert runner.draft is not None and not runner.draft.batch.states, "every request's draft state is freed"
    return [o.output for o in outs], r


def test_a_draft_model_changes_no_token(tiny_llama_dir: Path, tiny_model_dir: Any) -> None:
    """A draft equal to the target proposes the target's own greedy tokens: the greedy requests accept them all;
    a random draft (another tiny model, same vocabulary) is mostly wrong: the output is the same either way."""
    prompts = copy_prompts(3, 1000)
    plain, _ = run(tiny_llama_dir, prompts, None)
    greedy = [i for i in range(len(prompts)) if i % 3]  # those `run` decodes greedily
    same, r = draft_run(tiny_llama_dir, tiny_llama_dir, [prompts[i] for i in greedy], mixed=False)
    assert same == [plain[i] for i in greedy]
    counters = r.scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens == counters.num_draft_tokens
    other, r = draft_run(tiny_llama_dir, tiny_model_dir("qwen3"), prompts)
    assert other == plain
    counters = r.scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens < counters.num_draft_tokens


def test_tensor_parallel_speculation_changes_no_token(tiny_llama_dir: Path) -> None:
    """TP 2: every rank receives every draw (share_sampled) and rolls back alike; the output is TP 1's without
    speculation, with proposals accepted in full, in part and not at all."""
    prompts = copy_prompts(7, 1000)[:4]
    plain, _ = run(tiny_llama_dir, prompts, None)
    tp2 = TensorParallelRanks(tiny_llama_dir, 48, BLOCK, tp=2)
    try:
        speculated, r = run(tiny_llama_dir, prompts, SPEC, reference=plain, ranks=tp2)
        assert [runner.batch.states for runner in tp2.runners] == [{}, {}]
    finally:
        tp2.close()
    counters = r.scheduler.speculator.counters  # type: ignore[union-attr]
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, "the test lost its point"
    assert speculated == plain


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_parallel_speculation_changes_no_token(tiny_llama_dir: Path, tp: int) -> None:
    """PP 2 (and PP 2 x TP 2): only the last stage knows how many proposals were accepted; every other rank learns
    it from the request's next plan (its tokens, and its computed tokens rolled back), which speculation's
    lockstep builds after the result. The output is PP 1's without speculation, with proposals accepted in full,
    in part and not at all; at idle no block is held and no rank holds a row."""
    prompts = copy_prompts(7, 1000)[:4]
    plain, _ = run(tiny_llama_dir, prompts, None)
    if tp > 1:
        ranks: TensorParallelRanks | list[ModelRunner] = TensorParallelRanks(tiny_llama_dir, 48, BLOCK, tp=tp, pp=2)
    else:
        ranks = stage_runners(tiny_llama_dir, 48, BLOCK, stages=2)
    try:
        speculated, r = run(tiny_llama_dir, prompts, SPEC, reference=plain, ranks=ranks)
        runners = ranks.runners if isinstance(ranks, TensorParallelRanks) else ranks
        assert [runner.batch.states for runner in runners] == [{}] * len(runners)
    finally:
        if isinstance(ranks, TensorParallelRanks):
            ranks.close()
    assert r.mode.tokens_in_plan and r.scheduler.speculator is not None
    counters = r.scheduler.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, "the test lost its point"
    assert speculated == plain
    assert r.scheduler.blocks.num_free == r.scheduler.blocks.num_blocks


def test_a_draft_model_under_pipeline_parallelism_changes_no_token(tiny_llama_dir: Path) -> None:
    """PP 2: the draft runs on the last stage, which proposes after tokens it has sampled but not yet received in
    a plan; a draft equal to the target is accepted in full and the output is PP 1's without speculation."""
    prompts = copy_prompts(3, 1000)[:3]
    plain, _ = run(tiny_llama_dir, prompts, None)
    greedy = [i for i in range(len(prompts)) if i % 3]
    same, r = draft_run(tiny_llama_dir, tiny_llama_dir, [prompts[i] for i in greedy], mixed=False, stages=2)
    assert same == [plain[i] for i in greedy]
    counters = r.scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens == counters.num_draft_tokens


COPY_TASKS = [
    "Repeat this sentence exactly: The committee met on Tuesday to discuss the budget for the new library and "
    "agreed to fund the children's reading room.",
    "Correct the spelling and write the sentence again: Our trian left the staton at seven in the morning and "
    "reached the coast just before noon.",
    "Rename the variable total to amount in this code and print it again:\ndef add(items):\n    total = 0\n"
    "    for x in items:\n        total += x\n    return total",
]


def test_smollm2_ngram_speculation_changes_no_token(smollm2_dir: Path) -> None:
    """Real SmolLM2 (float32) on chat prompts whose answers copy them, so that n-gram proposals come true: greedy
    output with speculation on is the output with it off, token for token, and HF's argmax at every position."""
    from scheduler_node.text.tokenizer import ModelTokenizer

    tok = ModelTokenizer(smollm2_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": task}]) for task in COPY_TASKS]

    runner = load_runner(smollm2_dir, 64, BLOCK)  # one model for both runs: each engine starts from no rows

    def generate(spec: SpeculativeConfig | None) -> tuple[list[list[int]], EngineRun]:
        with EngineRun(runner, tokenizer_dir=smollm2_dir, speculative=spec) as r:
            outs = [r.add(p, 24) for p in prompts]
            r.run()
        return [o.output for o in outs], r

    plain, _ = generate(None)
    speculated, r = generate(SPEC)
    assert not runner.batch.states
    counters = r.scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_accepted_tokens > 0, "the test lost its point: no proposal came true"
    assert speculated == plain
    hf = load_hf(smollm2_dir)
    for prompt, output in zip(prompts, speculated):
        assert_teacher_forced(hf, prompt, output)
