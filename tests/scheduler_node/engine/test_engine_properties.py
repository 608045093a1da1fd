"""The engine core under random worlds and clients: whatever the KV size, block size, budget, max_model_len,
execution mode, policy and preemption mode, and whatever clients send (prompt and output lengths, n, priorities,
aborts, speculative decoding with proposals accepted at random) while an operator resizes the cache and a rank is
replaced by a smaller one, and while one request's logits turn non-finite or its steps crash with nobody blamed, the
loop never dies, every request ends (finished, aborted, or refused at the door with the field that is wrong), every
request but the faulty ones ends exactly as it would have, and at idle no block is held. The real EngineCore and
Scheduler run over stand-in workers (scheduler_node/engine/stand_in.py): no model, milliseconds a step. Requests pass
the gRPC door's validation first, as a client's would.

CI runs 200 examples (seconds); `MINIVLLM_PROPERTY_EXAMPLES=10000` runs more (docs/operations.md). On the code
before issue 25 it found, among others: a prompt that fills the cache never started under a watermark and the
engine stopped; n = 3 on a one-block cache stopped it too; a ResizeCache shrink left a request preempting itself
forever; max_model_len stayed above what a shrunk cache holds; a ResizeCache past a smaller replacement's blocks
failed steps (INTERNAL)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import serving_pb2 as pb
from proto.wire import ExecutionMode
from scheduler_node.api.validation import InvalidField, validate
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.engine.builder import resolve_max_model_len
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.outputs import Delta, ErrorStatus
from settings.speculative import SpeculativeConfig
from tests.support.stand_in import TOKEN, StandInRun, tokenizer

pytestmark = pytest.mark.unit

EXAMPLES = int(os.environ.get("MINIVLLM_PROPERTY_EXAMPLES", "200"))
FIRST_TOKEN = 100  # prompts are token ids from here on (inside every vocabulary)


@dataclass(frozen=True)
class World:
    num_blocks: int
    block_size: int
    budget: int
    seats: int
    model_limit: int  # the model's max_position_embeddings
    max_model_len: int  # --max-model-len (0: the model's, capped by the KV capacity)
    watermark: float
    policy: str
    preemption: str
    swap_blocks: int
    stages: int
    async_scheduling: bool
    prefix_caching: bool
    max_waiting: int
    speculative_tokens: int  # n-gram proposals per step, each accepted or not at random (0: no speculation)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    num_blocks = draw(st.integers(1, 48))
    block_size = draw(st.sampled_from([8, 16, 32]))
    capacity = num_blocks * block_size
    requested = draw(st.one_of(st.just(0), st.integers(2, capacity)))
    return World(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=draw(st.sampled_from([3, 16, 64, 2048])),
        seats=draw(st.integers(1, 6)),
        model_limit=draw(st.sampled_from([64, 4096])),
        max_model_len=requested,
        watermark=draw(st.sampled_from([0.0, 0.01, 0.05, 0.25])),
        policy=draw(st.sampled_from(["fcfs", "priority", "hybrid"])),
        preemption=draw(st.sampled_from(["recompute", "swap", "elastic"])),
        swap_blocks=draw(st.sampled_from([0, 4, 64])),
        stages=draw(st.integers(1, 3)),
        async_scheduling=draw(st.booleans()),
        prefix_caching=draw(st.booleans()),
        max_waiting=draw(st.sampled_from([0, 0, 3])),
        speculative_tokens=draw(st.sampled_from([0, 0, 1, 4])),
    )


@dataclass(frozen=True)
class Arrive:
    prompt: int | None  # tokens; None: what max_model_len leaves beside max_tokens, less `short` (-1: one too many)
    short: int
    max_tokens: int | None  # None: the rest of max_model_len
    n: int
    priority: int
    shared: bool  # starts with a prefix other requests share (prefix-cache hits)


@dataclass(frozen=True)
class Abort:
    which: int  # of the accepted requests, modulo their number


@dataclass(frozen=True)
class Resize:
    num_blocks: int  # Control.ResizeCache, modulo the world's blocks


@dataclass(frozen=True)
class Replace:
    num_blocks: int | None  # a rank is lost; its replacement holds this many blocks (modulo the world's; None: all)


@dataclass(frozen=True)
class Poison:
    """The next request to sample gets non-finite logits (the worker reports it: StepResult.faulted)."""


@dataclass(frozen=True)
class Crash:
    """The first request of the next plan that computes something makes every plan with it fail, and the worker
    cannot say whose fault it is (the engine must find it by running its step's requests alone)."""


Event = Arrive | Abort | Resize | Replace | Poison | Crash

arrivals = st.builds(
    Arrive,
    prompt=st.one_of(st.none(), st.integers(1, 40)),
    short=st.sampled_from([-1, 0, 0, 1, 2]),
    max_tokens=st.one_of(st.none(), st.integers(1, 20), st.integers(1, 20), st.just(100_000)),
    n=st.sampled_from([1, 1, 2, 3]),
    priority=st.sampled_from([10, 50, 90]),
    shared=st.booleans(),
)
events = st.one_of(  # mostly clients; now and then an operator or a fault
    arrivals,
    arrivals,
    arrivals,
    arrivals,
    st.builds(Abort, st.integers(0, 1_000)),
    st.builds(Resize, st.integers(1, 1_000)),
    st.builds(Replace, st.one_of(st.none(), st.integers(1, 1_000))),
    st.builds(Poison),
    st.builds(Crash),
)


@dataclass
class Accepted:
    request_id: str
    n: int
    prompt_tokens: int
    max_tokens: int
    aborted: bool = False


@dataclass
class Run:
    run: StandInRun
    accepted: list[Accepted] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # the field each refused request named
    shrunk_to: list[int] = field(default_factory=list)  # tokens the world held after each smaller replacement
    culprits: set[str] = field(default_factory=set)  # requests given non-finite logits or a crash (Poison, Crash)
    steps: int = 200  # bounds the steps a run may take: 10 x what each request takes alone, and some

    @property
    def engine(self) -> EngineCore:
        return self.run.engine


def make_run(world: World) -> Run:
    max_len = resolve_max_model_len(world.max_model_len, world.model_limit, world.num_blocks, world.block_size)
    config = SchedulerConfig(
        block_size=world.block_size,
        max_num_batched_tokens=world.budget,
        max_num_seqs=world.seats,
        max_model_len=max_len,
        enable_prefix_caching=world.prefix_caching,
        preemption_mode=world.preemption,  # type: ignore[arg-type]
        watermark=world.watermark,
        speculative=SpeculativeConfig(num_speculative_tokens=world.speculative_tokens)
        if world.speculative_tokens
        else None,
    )
    run = Run(
        StandInRun.build(
            config,
            world.num_blocks,
            mode=ExecutionMode.for_world(1, world.stages, world.async_scheduling),
            policy=world.policy,
            num_swap_blocks=world.swap_blocks,
            options=EngineOptions(max_waiting_requests=world.max_waiting),
        )
    )

    def blamed(handle: int) -> None:
        req = run.engine.scheduler.request_of(handle)
        assert req is not None, f"handle {handle}: a culprit that is not live"
        run.culprits.add(run.engine.outputs.request_of[req.req_id])

    run.run.workers.blamed = blamed
    return run


def arrive(run: Run, ev: Arrive, index: int) -> None:
    """What the gRPC door does with a Generate call: validate against the engine's limits, then submit."""
    engine = run.engine
    assert not engine.unavailable(), engine.unavailable()
    fill = engine.max_model_len - ev.short - (ev.max_tokens or 1)
    length = ev.prompt if ev.prompt is not None else max(1, fill)
    shared = list(range(FIRST_TOKEN, FIRST_TOKEN + 24)) if ev.shared else []
    prompt = (shared + [FIRST_TOKEN + 500 + index + i for i in range(length)])[:length]
    sampling = pb.SamplingParams(ignore_eos=True, temperature=0.0, n=ev.n)
    if ev.max_tokens is not None:
        sampling.max_tokens = ev.max_tokens
    request = pb.GenerateRequest(
        request_id=f"r{index}", prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling, priority=ev.priority
    )
    try:
        spec = validate(request, tokenizer(), engine.max_model_len, None, engine.compact_tokens)
    except InvalidField as exc:
        run.refused.append(exc.field)
        return
    if engine.queue_full(spec.n):
        run.refused.append("queue")
        return
    budget = engine.scheduler.config.max_num_batched_tokens
    run.steps += 10 * spec.n * (len(spec.prompt_token_ids) // budget + 1 + spec.max_tokens)
    run.run.submit(spec)
    run.accepted.append(Accepted(spec.request_id, spec.n, len(spec.prompt_token_ids), spec.max_tokens))


def apply(run: Run, ev: Event, index: int) -> None:
    engine, workers = run.engine, run.run.workers
    if isinstance(ev, Arrive):
        arrive(run, ev, index)
    elif isinstance(ev, Abort) and run.accepted:
        a = run.accepted[ev.which % len(run.accepted)]
        a.aborted = engine.abort(a.request_id) or a.aborted
    elif isinstance(ev, Resize):
        try:
            engine.resize_cache(1 + ev.num_blocks % engine.scheduler.blocks.num_blocks)
        except (ValueError, MemoryError):
            pass  # refused with a reason: the operator's call fails, nothing else changes
    elif isinstance(ev, Replace) and workers.all_ready:
        held = workers.capacity.num_kv_blocks
        blocks = held if ev.num_blocks is None else 1 + ev.num_blocks % held
        if blocks < held:
            run.shrunk_to.append(blocks * engine.scheduler.blocks.block_size)
        workers.replace_rank(blocks)
    elif isinstance(ev, Poison):
        workers.poison += 1
    elif isinstance(ev, Crash):
        workers.crash += 1
        run.steps += 100 + 20 * sum(a.n for a in run.accepted)  # its step's requests then run one at a time


def check_ends(run: Run) -> None:
    """Every sequence of every accepted request ended exactly once, with a status it may end with."""
    for a in run.accepted:
        deltas = run.run.streams[a.request_id].take_ready()
        # The stand-in samples TOKEN, and something else for a row whose logits it made non-finite: that never
        # reaches a client.
        assert {t for d in deltas for t in d.token_ids} <= {TOKEN}, (a.request_id, deltas)
        ends = [d for d in deltas if d.finish_reason]
        assert len(ends) == a.n, f"{a.request_id}: {len(ends)} of {a.n} sequences ended"
        for d in ends:
            if d.finish_reason == "error" and a.request_id in run.culprits and _its_own_fault(d):
                continue  # a faulty request fails alone: non-finite logits, or a crash found by running it alone
            if d.finish_reason == "error":
                # The one error a valid request may end with: a smaller replacement left it no room.
                assert d.error is not None and d.error.status is ErrorStatus.UNAVAILABLE, (a.request_id, d)
                assert "shrank" in d.error.message and run.shrunk_to, (a.request_id, d)
                assert a.prompt_tokens + a.max_tokens > min(run.shrunk_to), (a.request_id, d.error)
            elif d.finish_reason == "abort":
                assert a.aborted, f"{a.request_id}: aborted, by no one"
            else:
                assert d.finish_reason == "length", (a.request_id, d)
                assert d.completion_tokens == a.max_tokens, (a.request_id, d)


def _its_own_fault(d: Delta) -> bool:
    """The error a faulty request ends with: its logits were not finite, or its steps crashed."""
    assert d.error is not None, d
    if d.error.status is ErrorStatus.FAILED_PRECONDITION:
        return "not finite" in d.error.message
    return d.error.status is ErrorStatus.INTERNAL and "crashed" in d.error.message


def check_idle(run: Run) -> None:
    run.run.assert_idle()
    blocks = run.engine.scheduler.blocks
    assert run.engine.max_model_len <= blocks.usable_blocks * blocks.block_size, "max_model_len exceeds the cache"


async def scenario(world: World, script: list[tuple[Event, int]]) -> Run:
    run = make_run(world)
    run.run.start()
    try:
        for index, (ev, turns) in enumerate(script):
            apply(run, ev, index)
            for _ in range(turns):
                await asyncio.sleep(0)
        await run.run.until_idle(step_bound=run.steps)
    finally:
        await run.run.stop()
    return run


def check(world: World, script: list[tuple[Event, int]]) -> None:
    run = asyncio.run(scenario(world, script))
    check_ends(run)
    check_idle(run)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(world=worlds(), script=st.lists(st.tuples(events, st.integers(0, 40)), min_size=1, max_size=12))
def test_every_request_ends_and_every_block_comes_back(world: World, script: list[tuple[Event, int]]) -> None:
    check(world, script)
