"""The scheduler ⇄ worker messages on ZMQ: plain dataclasses, msgpack with an explicit, versioned layout.

Every message is `[WIRE_VERSION, kind, *fields]`. Decoding checks the version, the size and the type of every
field, so a malformed message raises `WireError` instead of reaching the engine. Never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, TypeVar, Union

import msgpack

# 2: results say whether an Interrupt reached them (a new message); cached requests carry new_token_ids, and
# with P > 1 stages the workers take sampled tokens from the plan instead of broadcasting them; a v1 process in
# such a world would wait on a broadcast that never comes.
# 3: the Assignment carries the execution mode and the world's KV size (a replacement worker allocates exactly it).
# 4: SamplingOptions carries penalties, min_p, logit_bias, bad words, min_tokens with the tokens that end the
# sequence, prompt_logprobs and structured output; results carry prompt logprobs. A v3 worker would misread the
# longer sampling record.
# 5: plans carry KV offload tier moves, results the time spent on them, Ready the tiers' sizes and the blocks a
# warm disk tier holds (scheduler_node/core/kv_tiers.py, worker_node/kv_offload.py).
WIRE_VERSION = 6
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

T = TypeVar("T")


class WireError(ValueError):
    """A message that is not a valid minivllm wire message."""


class Kind(IntEnum):
    HELLO = 1
    ASSIGNMENT = 2
    READY = 3
    PLAN = 4
    RESULT = 5
    SHUTDOWN = 6
    HEARTBEAT = 7
    STEP_ERROR = 8
    INTERRUPT = 9


def _check(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and kind is not bool and kind != (bool,):
        raise WireError(f"{what}: expected {kind}, got bool")
    if not isinstance(value, kind):
        raise WireError(f"{what}: expected {kind}, got {type(value).__name__}")
    return value


def _int_list(value: Any, what: str) -> list[int]:
    _check(value, list, what)
    for v in value:
        _check(v, int, what)
    return value


def _list_of(value: Any, item: Callable[[Any], T], what: str) -> list[T]:
    return [item(v) for v in _check(value, list, what)]


def _optional(value: Any, kind: type, what: str) -> Any:
    return None if value is None else _check(value, kind, what)


STRUCTURED_KINDS = ("json", "regex", "choice", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output text: a JSON schema, a regex, a choice of strings, or any JSON object.

    `spec` is the schema's JSON text, the regex, the JSON list of choices, or "" for json_object."""

    kind: str
    spec: str

    def to_wire(self) -> list[Any]:
        return [self.kind, self.spec]

    @classmethod
    def from_wire(cls, v: Any) -> StructuredOutput:
        kind, spec = _fixed(v, 2, "structured")
        if kind not in STRUCTURED_KINDS:
            raise WireError(f"structured kind {kind!r} is not one of {STRUCTURED_KINDS}")
        return cls(kind, _check(spec, str, "structured spec"))


@dataclass(slots=True)
class SamplingOptions:
    """What a worker needs to sample; stop conditions and max_tokens stay with the scheduler."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = None  # top alternatives to return besides the sampled token
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on tokens of the prompt and the output (HF, vLLM)
    frequency_penalty: float = 0.0  # times each token's count in the output
    presence_penalty: float = 0.0  # once for each token present in the output
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences whose last token is banned after
    # the others
    min_tokens: int = 0  # the tokens in stop_token_ids are banned until this many tokens are out
    # Every token that ends this sequence (eos unless ignored, and the request's stop_token_ids), filled in by the
    # engine: banned before min_tokens, and the ones a grammar allows where it may end.
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None  # each prompt token's logprob, plus this many top alternatives
    structured: StructuredOutput | None = None

    def to_wire(self) -> list[Any]:
        return [
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.logprobs,
            self.min_p,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
            [[t, b] for t, b in self.logit_bias.items()],
            self.bad_words,
            self.min_tokens,
            self.stop_token_ids,
            self.prompt_logprobs,
            None if self.structured is None else self.structured.to_wire(),
        ]

    @classmethod
    def from_wire(cls, v: Any) -> SamplingOptions:
        t, p, k, seed, lp, min_p, rep, freq, pres, bias, bad, min_tokens, stops, plp, structured = _fixed(
            v, 15, "sampling"
        )
        return cls(
            _float(t, "temperature"),
            _float(p, "top_p"),
            _check(k, int, "top_k"),
            _optional(seed, int, "seed"),
            _optional(lp, int, "logprobs"),
            _float(min_p, "min_p"),
            _float(rep, "repetition_penalty"),
            _float(freq, "frequency_penalty"),
            _float(pres, "presence_penalty"),
            {_check(tok, int, "logit_bias token"): _float(b, "logit_bias") for tok, b in _pairs_of(bias, "logit_bias")},
            _list_of(bad, lambda w: _int_list(w, "bad_words"), "bad_words"),
            _check(min_tokens, int, "min_tokens"),
            _int_list(stops, "stop_token_ids"),
            _optional(plp, int, "prompt_logprobs"),
            None if structured is None else StructuredOutput.from_wire(structured),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _float(value: Any, what: str) -> float:
    return float(_check(value, (float, int), what))


def _pairs_of(value: Any, what: str) -> list[list[Any]]:
    return [_fixed(pair, 2, what) for pair in _check(value, list, what)]


@dataclass(slots=True)
class NewRequest:
    """A request the worker has not seen (or lost through preemption): everything, in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingOptions
    block_ids: list[int]
    num_computed_tokens: int

    def to_wire(self) -> list[Any]:
        return [
            self.req_id,
            self.prompt_token_ids,
            self.output_token_ids,
            self.sampling.to_wire(),
            self.block_ids,
            self.num_computed_tokens,
        ]

    @classmethod
    def from_wire(cls, v: Any) -> NewRequest:
        rid, prompt, out, sampling, blocks, computed = _fixed(v, 6, "new_request")
        return cls(
            _check(rid, str, "req_id"),
            _int_list(prompt, "prompt_token_ids"),
            _int_list(out, "output_token_ids"),
            SamplingOptions.from_wire(sampling),
            _int_list(blocks, "block_ids"),
            _check(computed, int, "num_computed_tokens"),
        )


@dataclass(slots=True)
class CachedRequest:
    """A request the worker already holds: only the blocks and tokens added since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Tokens sampled since the workers last saw this request. Only with P > 1 pipeline stages: there the output
    # rank's samples reach the other ranks through the scheduler; with one stage every rank appends its own.
    new_token_ids: list[int] = field(default_factory=list)

    def to_wire(self) -> list[Any]:
        return [self.req_id, self.new_block_ids, self.num_computed_tokens, self.new_token_ids]

    @classmethod
    def from_wire(cls, v: Any) -> CachedRequest:
        rid, blocks, computed, tokens = _fixed(v, 4, "cached_request")
        return cls(
            _check(rid, str, "req_id"),
            _int_list(blocks, "new_block_ids"),
            _check(computed, int, "num_computed_tokens"),
            _int_list(tokens, "new_token_ids"),
        )


@dataclass(frozen=True, slots=True)
class TierMove:
    """One KV block copied between tiers (0 device, 1 host RAM, 2 disk) before a step's forward pass: an
    offload, a demotion to disk, or a load back into a device block. `block_hash` keys the block on disk."""

    src_tier: int
    src: int
    dst_tier: int
    dst: int
    block_hash: bytes

    def to_wire(self) -> list[Any]:
        return [self.src_tier, self.src, self.dst_tier, self.dst, self.block_hash]

    @classmethod
    def from_wire(cls, v: Any) -> TierMove:
        st, s, dt, d, h = _fixed(v, 5, "tier_move")
        move = cls(
            _check(st, int, "src_tier"),
            _check(s, int, "src"),
            _check(dt, int, "dst_tier"),
            _check(d, int, "dst"),
            _check(h, bytes, "block_hash"),
        )
        if not (0 <= move.src_tier <= 2 and 0 <= move.dst_tier <= 2) or move.src_tier == move.dst_tier:
            raise WireError(f"tier_move: tiers must be two different ones of 0, 1, 2, got {st} -> {dt}")
        if len(move.block_hash) > 64:
            raise WireError("tier_move: block_hash longer than 64 bytes")
        return move


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)  # forget them (finished or aborted)
    preempted_req_ids: list[str] = field(default_factory=list)  # forget them; they come back as new
    # Device work before the forward pass, in this order: swap out, copy, swap in.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Blocks replaced in tables the workers hold (copy-on-write, compaction): req_id -> [(index, block)].
    block_updates: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # KV offload tier moves, run in this order before the swaps and copies (scheduler_node/core/kv_tiers.py).
    tier_moves: list[TierMove] = field(default_factory=list)

    KIND = Kind.PLAN

    def to_wire(self) -> list[Any]:
        return [
            self.step_id,
            [r.to_wire() for r in self.new_requests],
            [r.to_wire() for r in self.cached_requests],
            self.num_scheduled_tokens,
            self.finished_req_ids,
            self.preempted_req_ids,
            [list(p) for p in self.swap_out],
            [list(p) for p in self.block_copies],
            [list(p) for p in self.swap_in],
            {r: [list(p) for p in u] for r, u in self.block_updates.items()},
            [m.to_wire() for m in self.tier_moves],
        ]

    @classmethod
    def from_wire(cls, v: Any) -> StepPlan:
        step, new, cached, sched, finished, preempted, out, copies, into, updates, moves = _fixed(v, 11, "plan")
        _check(sched, dict, "num_scheduled_tokens")
        for rid, n in sched.items():
            _check(rid, str, "num_scheduled_tokens key")
            _check(n, int, "num_scheduled_tokens value")
        _check(updates, dict, "block_updates")
        return cls(
            _check(step, int, "step_id"),
            _list_of(new, NewRequest.from_wire, "new_requests"),
            _list_of(cached, CachedRequest.from_wire, "cached_requests"),
            sched,
            _list_of(finished, lambda r: _check(r, str, "finished_req_ids"), "finished_req_ids"),
            _list_of(preempted, lambda r: _check(r, str, "preempted_req_ids"), "preempted_req_ids"),
            _pairs(out, "swap_out"),
            _pairs(copies, "block_copies"),
            _pairs(into, "swap_in"),
            {_check(r, str, "block_updates key"): _pairs(u, "block_updates") for r, u in updates.items()},
            _list_of(moves, TierMove.from_wire, "tier_moves"),
        )

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def has_work(self) -> bool:
        """Anything for the workers to do or learn (an empty plan is not sent)."""
        return bool(
            self.num_scheduled_tokens
            or self.finished_req_ids
            or self.preempted_req_ids
            or self.block_copies
            or self.swap_out
            or self.swap_in
            or self.tier_moves
        )


def _pairs(value: Any, what: str) -> list[tuple[int, int]]:
    out = []
    for pair in _check(value, list, what):
        a, b = _fixed(pair, 2, what)
        out.append((_check(a, int, what), _check(b, int, what)))
    return out


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]]  # best first

    def to_wire(self) -> list[Any]:
        return [self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, v: Any) -> TokenLogprobs:
        lp, top = _fixed(v, 2, "logprobs")
        pairs = [_fixed(t, 2, "top logprob") for t in _check(top, list, "top")]
        return cls(
            float(_check(lp, (float, int), "logprob")),
            [(_check(t, int, "token"), float(_check(p, (float, int), "lp"))) for t, p in pairs],
        )


@dataclass(slots=True)
class StepResult:
    step_id: int
    sampled: dict[str, list[int]]  # only the requests that reached the end of their tokens this step
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    execute_ms: float = 0.0
    idle_ms: float = 0.0  # the worker's wait between the end of its previous step and the start of this one
    # An Interrupt reached the step: its diffs and block operations were applied, its tokens not computed.
    interrupted: bool = False
    # Requests that asked for prompt logprobs: the position of the first prompt token this step scored, and the
    # logprobs of that token and the ones after it (a chunk of the prompt).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    tier_ms: float = 0.0  # time spent on the plan's KV tier moves (included in execute_ms)

    KIND = Kind.RESULT

    def to_wire(self) -> list[Any]:
        lps = {r: [x.to_wire() for x in v] for r, v in self.logprobs.items()}
        prompt = {r: [first, [x.to_wire() for x in v]] for r, (first, v) in self.prompt_logprobs.items()}
        return [self.step_id, self.sampled, lps, self.execute_ms, self.idle_ms, self.interrupted, prompt, self.tier_ms]

    @classmethod
    def from_wire(cls, v: Any) -> StepResult:
        step, sampled, lps, ms, idle, interrupted, prompt, tier_ms = _fixed(v, 8, "result")
        _check(sampled, dict, "sampled")
        for rid, toks in sampled.items():
            _check(rid, str, "sampled key")
            _int_list(toks, "sampled tokens")
        _check(lps, dict, "logprobs")
        logprobs = {
            _check(r, str, "logprobs key"): _list_of(x, TokenLogprobs.from_wire, "logprobs") for r, x in lps.items()
        }
        return cls(
            _check(step, int, "step_id"),
            sampled,
            logprobs,
            float(_check(ms, (float, int), "ms")),
            float(_check(idle, (float, int), "idle_ms")),
            _check(interrupted, bool, "interrupted"),
            {
                _check(r, str, "prompt_logprobs key"): _prompt_chunk(x)
                for r, x in _check(prompt, dict, "prompt").items()
            },
            float(_check(tier_ms, (float, int), "tier_ms")),
        )


def _prompt_chunk(value: Any) -> tuple[int, list[TokenLogprobs]]:
    first, lps = _fixed(value, 2, "prompt_logprobs")
    return _check(first, int, "prompt_logprobs position"), _list_of(lps, TokenLogprobs.from_wire, "prompt_logprobs")


@dataclass(frozen=True, slots=True)
class ExecutionMode:
    """How plans flow through a world, computed once from its shape (TP, PP) and async scheduling, and read by
    the engine, the scheduler and every worker instead of each deriving it again."""

    plans_in_flight: int = 1  # plans sent and not yet answered, at most
    # Each plan in flight holds requests no other in-flight plan holds (P > 1 stages: stage s runs plan N+1
    # while stage s+1 runs plan N); a request is scheduled again only once its result is applied.
    disjoint_plans: bool = False
    # The output rank's sampled tokens reach the other ranks in the next plan (no end-of-step broadcast). Else
    # every rank appends the tokens itself, and a plan may be built before the previous one's tokens are known.
    tokens_in_plan: bool = False
    interruptible: bool = False  # a lone worker may skip plans in flight (ranks of a bigger world could stop
    # at different layers and leave a collective half-joined)

    @classmethod
    def for_world(cls, tensor_parallel_size: int, pipeline_parallel_size: int, async_scheduling: bool) -> ExecutionMode:
        stages = pipeline_parallel_size > 1
        if not async_scheduling:
            plans = 1
        else:
            plans = pipeline_parallel_size if stages else 2
        lone = tensor_parallel_size * pipeline_parallel_size == 1
        return cls(plans, stages, stages, lone)

    def to_wire(self) -> list[Any]:
        return [self.plans_in_flight, self.disjoint_plans, self.tokens_in_plan, self.interruptible]

    @classmethod
    def from_wire(cls, v: Any) -> ExecutionMode:
        plans, disjoint, tokens, interruptible = _fixed(v, 4, "execution_mode")
        mode = cls(
            _check(plans, int, "plans_in_flight"),
            _check(disjoint, bool, "disjoint_plans"),
            _check(tokens, bool, "tokens_in_plan"),
            _check(interruptible, bool, "interruptible"),
        )
        if mode.plans_in_flight < 1:
            raise WireError(f"plans_in_flight must be >= 1, got {mode.plans_in_flight}")
        return mode


@dataclass(slots=True)
class WorkerHello:
    """A worker introduces itself; the scheduler answers with an Assignment."""

    host: str
    pid: int
    device: str

    KIND = Kind.HELLO

    def to_wire(self) -> list[Any]:
        return [self.host, self.pid, self.device]

    @classmethod
    def from_wire(cls, v: Any) -> WorkerHello:
        host, pid, device = _fixed(v, 3, "hello")
        return cls(_check(host, str, "host"), _check(pid, int, "pid"), _check(device, str, "device"))


@dataclass(slots=True)
class Assignment:
    """The scheduler's answer to Hello: which rank this worker is, what it serves, and where the world meets.

    Rank r is TP rank r % tensor_parallel_size of pipeline stage r // tensor_parallel_size (proto/parallel.py).
    With a world of more than one worker, every rank joins torch.distributed at `distributed_init`
    (host:port of rank 0's rendezvous store, which rank 0 opens).
    """

    rank: int
    world_size: int
    model: str
    dtype: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_init: str = ""  # "host:port" of the rendezvous; "" for a world of one
    device: str = ""  # the device the placement chose ("cuda:3", "cpu"); "" leaves it to the worker
    distributed_timeout_s: float = 300.0  # a collective or the rendezvous waiting longer than this fails
    mode: ExecutionMode = field(default_factory=ExecutionMode)
    # The world's KV size, fixed when its first world got ready: a replacement allocates exactly this many device
    # and swap blocks, so it fits the scheduler's table. On the first join 0 (-1 for swap) lets the worker size
    # itself from its memory flags.
    num_kv_blocks: int = 0
    num_swap_blocks: int = -1

    KIND = Kind.ASSIGNMENT

    def to_wire(self) -> list[Any]:
        return [
            self.rank,
            self.world_size,
            self.model,
            self.dtype,
            self.block_size,
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.distributed_init,
            self.device,
            self.distributed_timeout_s,
            self.mode.to_wire(),
            self.num_kv_blocks,
            self.num_swap_blocks,
        ]

    @classmethod
    def from_wire(cls, v: Any) -> Assignment:
        rank, world, model, dtype, bs, mnbt, mns, tp, pp, init, device, timeout, mode, kv, swap = _fixed(
            v, 15, "assignment"
        )
        a = cls(
            _check(rank, int, "rank"),
            _check(world, int, "world_size"),
            _check(model, str, "model"),
            _check(dtype, str, "dtype"),
            _check(bs, int, "block_size"),
            _check(mnbt, int, "max_num_batched_tokens"),
            _check(mns, int, "max_num_seqs"),
            _check(tp, int, "tensor_parallel_size"),
            _check(pp, int, "pipeline_parallel_size"),
            _check(init, str, "distributed_init"),
            _check(device, str, "device"),
            float(_check(timeout, (float, int), "distributed_timeout_s")),
            ExecutionMode.from_wire(mode),
            _check(kv, int, "num_kv_blocks"),
            _check(swap, int, "num_swap_blocks"),
        )
        if a.num_kv_blocks < 0 or a.num_swap_blocks < -1:
            raise WireError("num_kv_blocks must be >= 0 and num_swap_blocks >= -1")
        if a.tensor_parallel_size < 1 or a.pipeline_parallel_size < 1:
            raise WireError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if a.tensor_parallel_size * a.pipeline_parallel_size != a.world_size:
            raise WireError(
                f"world_size {a.world_size} != tensor_parallel_size {a.tensor_parallel_size} "
                f"x pipeline_parallel_size {a.pipeline_parallel_size}"
            )
        if not 0 <= a.rank < a.world_size:
            raise WireError(f"rank {a.rank} is outside a world of {a.world_size}")
        if a.world_size > 1 and ":" not in a.distributed_init:
            raise WireError(f"distributed_init must be host:port for a world of {a.world_size}")
        return a


@dataclass(slots=True)
class WorkerReady:
    """The worker loaded its shard and sized its KV cache and swap space."""

    rank: int
    num_kv_blocks: int
    kv_cache_bytes: int
    num_host_blocks: int = 0  # swap space, in blocks
    swap_bytes_per_s: float = 0.0  # measured device ⇄ host copy bandwidth (0: unknown)
    kv_format: str = ""  # what its KV is stored as: bfloat16, int8, fp8_e4m3, ...
    num_ram_tier_blocks: int = 0  # KV offload tiers (--kv-offload-ram, --kv-offload-disk-size), in blocks
    num_disk_tier_blocks: int = 0
    disk_tier_blocks: list[tuple[int, bytes]] = field(default_factory=list)  # (slot, block hash) found intact

    KIND = Kind.READY

    def to_wire(self) -> list[Any]:
        return [
            self.rank,
            self.num_kv_blocks,
            self.kv_cache_bytes,
            self.num_host_blocks,
            self.swap_bytes_per_s,
            self.kv_format,
            self.num_ram_tier_blocks,
            self.num_disk_tier_blocks,
            [[slot, h] for slot, h in self.disk_tier_blocks],
        ]

    @classmethod
    def from_wire(cls, v: Any) -> WorkerReady:
        rank, blocks, size, host, bw, kv_format, ram, disk, found = _fixed(v, 9, "ready")
        return cls(
            _check(rank, int, "rank"),
            _check(blocks, int, "num_kv_blocks"),
            _check(size, int, "bytes"),
            _check(host, int, "num_host_blocks"),
            float(_check(bw, (float, int), "swap_bytes_per_s")),
            _check(kv_format, str, "kv_format"),
            _check(ram, int, "num_ram_tier_blocks"),
            _check(disk, int, "num_disk_tier_blocks"),
            [
                (_check(slot, int, "disk_tier_blocks slot"), _check(h, bytes, "disk_tier_blocks hash"))
                for slot, h in _pairs_of(found, "disk_tier_blocks")
            ],
        )


@dataclass(slots=True)
class Shutdown:
    reason: str

    KIND = Kind.SHUTDOWN

    def to_wire(self) -> list[Any]:
        return [self.reason]

    @classmethod
    def from_wire(cls, v: Any) -> Shutdown:
        (reason,) = _fixed(v, 1, "shutdown")
        return cls(_check(reason, str, "reason"))


@dataclass(slots=True)
class Heartbeat:
    """Sent both ways while a worker is ready. The scheduler's carries its --heartbeat-timeout, so a worker
    knows how long a silent scheduler may stay silent before it is considered gone."""

    rank: int
    seq: int
    timeout_s: float  # the sender's heartbeat timeout: silence longer than this means the peer is gone

    KIND = Kind.HEARTBEAT

    def to_wire(self) -> list[Any]:
        return [self.rank, self.seq, self.timeout_s]

    @classmethod
    def from_wire(cls, v: Any) -> Heartbeat:
        rank, seq, timeout = _fixed(v, 3, "heartbeat")
        timeout_s = float(_check(timeout, (float, int), "timeout_s"))
        if not 0 < timeout_s < 1e6:  # NaN fails too
            raise WireError(f"timeout_s must be in (0, 1e6), got {timeout_s}")
        return cls(_check(rank, int, "rank"), _check(seq, int, "seq"), timeout_s)


@dataclass(slots=True)
class StepError:
    """A worker could not execute a plan (instead of its StepResult); the worker itself keeps running."""

    step_id: int
    rank: int
    reason: str

    KIND = Kind.STEP_ERROR

    def to_wire(self) -> list[Any]:
        return [self.step_id, self.rank, self.reason]

    @classmethod
    def from_wire(cls, v: Any) -> StepError:
        step, rank, reason = _fixed(v, 3, "step_error")
        return cls(_check(step, int, "step_id"), _check(rank, int, "rank"), _check(reason, str, "reason"))


@dataclass(slots=True)
class Interrupt:
    """Scheduler to a lone worker: steps first..last, already sent, are not to compute their tokens (a request
    that outranks them arrived). The step running stops at its next layer boundary; each of them still applies
    its diffs and block operations and is answered with an `interrupted` StepResult."""

    first_step_id: int
    last_step_id: int

    KIND = Kind.INTERRUPT

    def to_wire(self) -> list[Any]:
        return [self.first_step_id, self.last_step_id]

    @classmethod
    def from_wire(cls, v: Any) -> Interrupt:
        first, last = _fixed(v, 2, "interrupt")
        return cls(_check(first, int, "first_step_id"), _check(last, int, "last_step_id"))


Message = Union[WorkerHello, Assignment, WorkerReady, StepPlan, StepResult, Shutdown, Heartbeat, StepError, Interrupt]
_BY_KIND: dict[int, Any] = {
    c.KIND: c
    for c in (WorkerHello, Assignment, WorkerReady, StepPlan, StepResult, Shutdown, Heartbeat, StepError, Interrupt)
}


def _fixed(value: Any, n: int, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) != n:
        raise WireError(f"{what}: expected a list of {n} fields")
    return value


def encode(message: Message) -> bytes:
    data: bytes = msgpack.packb([WIRE_VERSION, int(message.KIND), *message.to_wire()], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return data


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not msgpack: {exc}") from exc
    if not isinstance(items, list) or len(items) < 2:
        raise WireError("expected [version, kind, *fields]")
    version, kind, *fields = items
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version!r}, this build speaks {WIRE_VERSION}")
    cls = _BY_KIND.get(kind) if isinstance(kind, int) else None
    if cls is None:
        raise WireError(f"unknown message kind {kind!r}")
    try:
        return cls.from_wire(fields)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from exc
