"""Live migration in the engine (issue 31): `migrate` ends each migratable sequence between steps with its state,
and a request submitted with those states (`RequestSpec.resume`) continues at the same output position. Greedy,
seeded and n > 1 outputs, and their text with a stop string's hold-back, are those of an undisturbed run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from proto.wire import SamplingOptions
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import FinishReason, RequestSpec
from scheduler_node.engine.outputs import Delta
from tests.support.engine import EngineRun, load_runner
from tests.support.ops import prompt_ids

pytestmark = pytest.mark.model

BLOCK = 16
SHARED = prompt_ids(5, 20)  # a prefix the prompts share: the resumed prefill finds it cached

CASES = [  # (prompt, sampling, n, stop strings)
    (SHARED + prompt_ids(1, 5), SamplingOptions(temperature=0.0), 1, []),
    (SHARED + prompt_ids(2, 9), SamplingOptions(temperature=0.9, seed=11), 1, ["zq~"]),  # text held back
    (prompt_ids(3, 13), SamplingOptions(temperature=0.8, top_k=50, seed=4), 3, []),
    (SHARED + prompt_ids(4, 3), SamplingOptions(temperature=0.0), 2, ["Qz!#"]),
]
MAX_TOKENS = 14


@dataclasses.dataclass(slots=True)
class Seq:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    migrated: SequenceResume | None = None

    def take(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.completion_tokens = delta.completion_tokens or self.completion_tokens
        self.migrated = delta.migrated or self.migrated


def spec(i: int, case: tuple, **kw: object) -> RequestSpec:
    prompt, sampling, n, stop = case
    return RequestSpec(f"c{i}{kw.get('request_id', '')}", prompt, sampling, MAX_TOKENS, stop, True, n, 50)


def test_migrated_requests_resume_with_the_tokens_and_text_of_an_undisturbed_run(tiny_llama_dir: Path) -> None:
    with EngineRun(load_runner(tiny_llama_dir, 40, BLOCK), tokenizer_dir=tiny_llama_dir) as run:
        engine = run.engine
        undisturbed: list[list[Seq]] = []
        moved: list[list[Seq]] = []

        async def scenario() -> None:
            for i, case in enumerate(CASES):  # one at a time: each its own run
                seqs = [Seq() for _ in range(case[2])]
                async for delta in engine.submit(spec(i, case)):
                    seqs[delta.index].take(delta)
                undisturbed.append(seqs)
            # All at once, migratable; moved off after the step that gave every sequence a few tokens (the tokens
            # of plans still in flight are dropped, and sampled again where they resume).
            migrated: list[int] = []

            def after_step() -> None:
                live = engine.scheduler.requests.values()
                if (
                    not migrated
                    and len(live) == sum(c[2] for c in CASES)
                    and all(len(r.output_token_ids) >= 5 for r in live)
                ):
                    migrated.append(engine.migrate())

            engine.after_step = after_step
            streams = [engine.submit(dataclasses.replace(spec(i, c), migratable=True)) for i, c in enumerate(CASES)]
            firsts = [[Seq() for _ in range(c[2])] for c in CASES]
            for stream, seqs in zip(streams, firsts):
                async for delta in stream:
                    seqs[delta.index].take(delta)
            assert migrated == [len(CASES)]
            assert engine.scheduler.blocks.num_free == 40, "a migrated request's blocks are freed at once"
            for i, (case, seqs) in enumerate(zip(CASES, firsts)):
                states = tuple(s.migrated for s in seqs if s.migrated is not None)
                assert len(states) == case[2] and all(s.finish_reason is FinishReason.MIGRATED for s in seqs)
                resumed = dataclasses.replace(spec(i, case), request_id=f"c{i}-resumed", resume=states)
                async for delta in engine.submit(resumed):
                    seqs[delta.index].take(delta)
                moved.append(seqs)

        run.serve(scenario)
        assert engine.scheduler.blocks.num_free == 40
    for case, want, got in zip(CASES, undisturbed, moved):
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids, case
            assert g.text == w.text, case
            assert (g.finish_reason, g.completion_tokens) == (w.finish_reason, w.completion_tokens) == ("length", 14)


def test_an_unmigratable_request_runs_on_through_a_migration(tiny_llama_dir: Path) -> None:
    """A request whose door takes no "migrated" end (the OpenAI door, a client straight to the replica) is
    not moved: a Drain with migrate still lets it finish."""
    with EngineRun(load_runner(tiny_llama_dir, 16, BLOCK), tokenizer_dir=tiny_llama_dir) as run:
        seq = Seq()

        async def scenario() -> None:
            stream = run.engine.submit(spec(0, CASES[0]))
            async for delta in stream:
                seq.take(delta)
                if len(seq.token_ids) == 3:
                    assert run.engine.migrate() == 0

        run.serve(scenario)
    assert (seq.finish_reason, len(seq.token_ids), seq.migrated) == ("length", MAX_TOKENS, None)
