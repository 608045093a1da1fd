"""The scheduler ⇄ worker messages on ZMQ: typed msgspec Structs, msgpack on the wire, versioned and checked.

Each message is written once, as a Struct: its fields in order are its layout (array-like, so no field names travel)
and its kind (`Kind`) is the tag that comes first. A frame is `[WIRE_VERSION, [kind, *fields]]`. Decoding checks the
size, the version, and every field against its type, its bounds (`Meta`) and the message's own rules
(`__post_init__`), so a malformed message raises `WireError` naming the field instead of reaching the engine.
Messages are trees, never cycles, so their Structs are left out of the garbage collector's tracking (`gc=False`):
a plan of thousands of requests adds nothing for a collection to walk. Never pickle.

Requests travel as short integer handles the scheduler assigns at admission (its string ids stay with it): a
steady decode request costs a plan about 8 bytes.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
import msgspec.inspect
from msgspec import Meta

# 2: results say whether an Interrupt reached them (a new message); cached requests carry new_token_ids, and
# with P > 1 stages the workers take sampled tokens from the plan instead of broadcasting them; a v1 process in
# such a world would wait on a broadcast that never comes.
# 3: the Assignment carries the execution mode and the world's KV size (a replacement worker allocates exactly it).
# 4: SamplingOptions carries penalties, min_p, logit_bias, bad words, min_tokens with the tokens that end the
# sequence, prompt_logprobs and structured output; results carry prompt logprobs. A v3 worker would misread the
# longer sampling record.
# 5: msgspec Structs in a `[version, [kind, *fields]]` frame; requests are integer handles, each scheduled request
# carries its own token count (no separate map repeating the ids), logit_bias is a map. A v4 peer's flat frame is
# refused by its version.
# 6: plans carry KV offload tier moves, results the time spent on them, Ready the KV format, the tiers' sizes and
# the blocks a warm disk tier holds (scheduler_node/core/kv_tiers.py, worker_node/kv_offload.py).
# 7: results name the tier loads that failed (a disk block corrupted since start) and the requests left out of
# the step for reading them, which the scheduler has recomputed (a v6 scheduler would use the bad KV); and the
# time the tier loads took.
# 8: per-request KV precision: the Assignment carries the compact pool's share, format and (for a replacement) size,
# Ready the compact pool's blocks, bytes and format, plans the first compact block id (core/kv_precision.py). A v6
# worker would read compact block ids as full ones (a v7 one, too).
# 9: embeddings and reasoning grammars: SamplingOptions.pooling, StepResult.pooled, structured kind "lark" (a v8
# worker would refuse the longer records, and sample an embedding request without pooling it).
# 10: cached requests carry proposed tokens (speculative decoding) and results may carry several tokens per request
# (the accepted proposals and one more); a v9 worker would compute the proposals as known tokens.
# 11: LoRA: a NewRequest names its adapter and the worker slot it runs in (a v10 worker would run the base model).
# 12: LoRA host tier: the adapter record carries --max-cpu-loras (a v11 worker would refuse the longer record).
# 13: disaggregated prefill/decode: plans carry KV imports (pull a prefix from another world's ranks), lease grants
# and revocations (worker_node/kv_transfer.py), Ready the rank's KV exporter address. A v12 worker would compute a
# prefix the scheduler counts as imported.
# 14: a draft model (speculative decoding): Assignment.draft_model, StepPlan.propose, StepResult.drafts (a v13
# worker would never propose, and the requests would wait on proposals that never come).
WIRE_VERSION = 14
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# libzmq's own ZMTP heartbeats, set on both ends of the worker socket: a quiet connection is PINGed this often by
# libzmq's I/O thread (so a busy Python thread does not drop it), and dropped after the heartbeat timeout.
ZMQ_HEARTBEAT_IVL_MS = 1000
WORKER_JOIN_TIMEOUT_S = 600.0  # a worker still loading after this long gives its rank back: --worker-join-timeout
HEARTBEAT_TIMEOUT_S = 10.0  # silence after which a peer is gone: --heartbeat-timeout's default, a worker's own

Count = Annotated[int, Meta(ge=0)]
Handle = Annotated[int, Meta(ge=0)]  # a request's id on the wire
BlockPair = tuple[int, int]


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


class Record(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A part of a message: an array of its fields in order."""


STRUCTURED_KINDS = ("json", "regex", "choice", "json_object", "lark")


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """A constraint on the output text: a JSON schema, a regex, a choice of strings, any JSON object, or a grammar.

    `spec` is the schema's JSON text, the regex, the JSON list of choices, "" for json_object, or llguidance's Lark
    text (the doors write one to apply a constraint after the model's reasoning: proto/structured.py)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise WireError(f"structured kind {self.kind!r} is not one of {STRUCTURED_KINDS}")


class SamplingOptions(Record):
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
    logit_bias: dict[int, float] = {}
    bad_words: list[list[int]] = []  # token sequences whose last token is banned after the others
    min_tokens: int = 0  # the tokens in stop_token_ids are banned until this many tokens are out
    # Every token that ends this sequence (eos unless ignored, and the request's stop_token_ids), filled in by the
    # engine: banned before min_tokens, and the ones a grammar allows where it may end.
    stop_token_ids: list[int] = []
    prompt_logprobs: int | None = None  # each prompt token's logprob, plus this many top alternatives
    structured: StructuredOutput | None = None
    # An embedding request: the prompt's final hidden states pooled ("last" token's, or the "mean" of all), in
    # StepResult.pooled; "" for generation.
    pooling: Literal["", "last", "mean"] = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class LoraAdapter(Record):
    """The LoRA adapter a request runs with: its id (never reused for other weights), its PEFT folder, and the worker
    slot the scheduler placed it in; a worker whose slot holds another id loads it from the folder first."""

    id: Annotated[int, Meta(ge=1)]
    path: Annotated[str, Meta(max_length=4096)]
    slot: Annotated[int, Meta(ge=0, le=4095)]
    # Adapters evicted from a slot that the workers keep in host memory (least recently used first out), so
    # a reload skips the disk: --max-cpu-loras, the same for every request (the scheduler mirrors the tier).
    host_slots: Annotated[int, Meta(ge=0, le=4096)] = 0


class NewRequest(Record):
    """A request the workers do not hold (new, or back after preemption): everything, in full."""

    handle: Handle
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingOptions
    block_ids: list[int]
    num_computed_tokens: Count
    num_scheduled_tokens: Annotated[int, Meta(ge=1)]  # tokens this step computes, from num_computed_tokens on
    lora: LoraAdapter | None = None  # None: the base model


class CachedRequest(Record):
    """A request the workers hold: where it is, what this step computes, and what was added since its last plan."""

    handle: Handle
    num_computed_tokens: Count
    num_scheduled_tokens: Annotated[int, Meta(ge=1)]
    # Tuples: a steady decode's are empty, and an empty tuple costs neither an allocation nor the collector's time.
    new_block_ids: tuple[int, ...] = ()
    # Tokens sampled since the workers last saw this request. Only with P > 1 pipeline stages: there the output
    # rank's samples reach the other ranks through the scheduler; with one stage every rank appends its own.
    new_token_ids: tuple[int, ...] = ()
    # Speculative decoding: the last len(draft_token_ids) of the num_scheduled_tokens are these proposals. The
    # worker scores them, samples every position, and keeps the longest prefix its samples agree with, plus the
    # token sampled after it (worker_node/spec_decode.py); the result's tokens for this request are those.
    draft_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.draft_token_ids) >= self.num_scheduled_tokens:
            raise WireError(
                f"request {self.handle}: {len(self.draft_token_ids)} draft_token_ids in "
                f"{self.num_scheduled_tokens} scheduled tokens (the first must be a known one)"
            )


class TierMove(Record):
    """One KV block copied between tiers (0 device, 1 host RAM, 2 disk) before a step's forward pass: an
    offload, a demotion to disk, or a load back into a device block. `block_hash` keys the block on disk."""

    src_tier: Annotated[int, Meta(ge=0, le=2)]
    src: Count
    dst_tier: Annotated[int, Meta(ge=0, le=2)]
    dst: Count
    block_hash: Annotated[bytes, Meta(max_length=64)]


class KVImport(Record):
    """A request's prefix blocks pulled from another world's ranks before the forward pass (disaggregated
    prefill → decode): rank r pulls the lease's `src` blocks from `addresses[r]` into its own `dst` blocks.
    `hashes` are the blocks' chained hashes: what a failed pull reports (`StepResult.failed_loads`)."""

    addresses: list[Annotated[str, Meta(max_length=256)]]
    lease: Annotated[bytes, Meta(min_length=16, max_length=16)]
    src: list[Count]
    dst: list[Count]
    hashes: list[Annotated[bytes, Meta(max_length=64)]]


class KVGrant(Record):
    """Blocks this world's ranks serve under a lease once the step that carries it has run (a prefill's prompt)."""

    lease: Annotated[bytes, Meta(min_length=16, max_length=16)]
    blocks: list[Count]


class Message(Record):
    """A whole message: its kind comes first on the wire."""

    def check(self) -> None:
        """Rules across fields, checked where the message arrives (raise WireError); types and bounds are the
        fields' own."""


class StepPlan(Message, tag=int(Kind.PLAN)):
    step_id: int
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    finished: list[Handle] = []  # forget them (finished or aborted)
    preempted: list[Handle] = []  # forget them; they come back as new
    # Device work before the forward pass, in this order: swap out, copy, swap in.
    swap_out: list[BlockPair] = []  # (device block, host block)
    block_copies: list[BlockPair] = []  # (source, destination)
    swap_in: list[BlockPair] = []  # (host block, device block)
    # Blocks replaced in tables the workers hold (copy-on-write, compaction): handle -> [(index, block)].
    block_updates: dict[Handle, list[BlockPair]] = {}
    # KV offload tier moves, in this order, after the swap-out and before copies and swap-in (core/kv_tiers.py).
    tier_moves: list[TierMove] = []
    # Per-request KV precision (core/kv_precision.py): block ids from here on are the compact pool's (id - base
    # there); 0: the world keeps no compact pool.
    compact_block_base: Count = 0
    # Disaggregated prefill/decode (worker_node/kv_transfer.py): leases revoked before anything else runs, KV
    # pulled from another world after the block operations, leases granted after the forward pass.
    kv_revokes: list[Annotated[bytes, Meta(min_length=16, max_length=16)]] = []
    kv_imports: list[KVImport] = []
    kv_grants: list[KVGrant] = []
    # Speculative decoding with a draft model: the requests of this plan whose next tokens the draft proposes
    # once this step's are known (StepResult.drafts).
    propose: list[Handle] = []

    def check(self) -> None:
        for i, m in enumerate(self.tier_moves):
            if m.src_tier == m.dst_tier:
                raise WireError(f"tier_moves[{i}]: tiers must be two different ones of 0, 1, 2, got {m.src_tier}")
        for i, imp in enumerate(self.kv_imports):
            if not len(imp.src) == len(imp.dst) == len(imp.hashes):
                raise WireError(f"kv_imports[{i}]: src, dst and hashes must have one entry per block")

    @property
    def num_scheduled_tokens(self) -> dict[int, int]:
        """Tokens each request computes this step, by handle: the new requests, then the cached ones."""
        scheduled = {r.handle: r.num_scheduled_tokens for r in self.new_requests}
        scheduled.update((r.handle, r.num_scheduled_tokens) for r in self.cached_requests)
        return scheduled

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.cached_requests)

    @property
    def total_tokens(self) -> int:
        new = sum(r.num_scheduled_tokens for r in self.new_requests)
        return new + sum(r.num_scheduled_tokens for r in self.cached_requests)

    @property
    def has_work(self) -> bool:
        """Anything for the workers to do or learn (an empty plan is not sent)."""
        return bool(
            self.new_requests
            or self.cached_requests
            or self.finished
            or self.preempted
            or self.block_copies
            or self.swap_out
            or self.swap_in
            or self.tier_moves
            or self.kv_revokes
            or self.kv_imports
            or self.kv_grants
        )


class TokenLogprobs(Record):
    logprob: float
    top: list[tuple[int, float]]  # best first


class StepResult(Message, tag=int(Kind.RESULT)):
    step_id: int
    # Only the requests that reached the end of their tokens this step: one token each, or for a request with
    # proposals the accepted ones and the one sampled after them.
    sampled: dict[Handle, list[int]]
    logprobs: dict[Handle, list[TokenLogprobs]] = {}
    execute_ms: float = 0.0
    idle_ms: float = 0.0  # the worker's wait between the end of its previous step and the start of this one
    # An Interrupt reached the step: its diffs and block operations were applied, its tokens not computed.
    interrupted: bool = False
    # Requests that asked for prompt logprobs: the position of the first prompt token this step scored, and the
    # logprobs of that token and the ones after it (a chunk of the prompt).
    prompt_logprobs: dict[Handle, tuple[int, list[TokenLogprobs]]] = {}
    tier_ms: float = 0.0  # time spent on the plan's KV tier moves (included in execute_ms)
    tier_load_ms: float = 0.0  # of which loading blocks back into the device cache
    # Tier loads some rank could not do (the block's hash; its disk copy failed its check), and the requests of
    # this step that read those blocks and were therefore not computed: the scheduler has them recompute.
    failed_loads: list[Annotated[bytes, Meta(max_length=64)]] = []
    load_skipped: list[Handle] = []
    # Disk tier writes some rank could not do (a full or failing disk; the block's hash): the block is not on disk.
    failed_stores: list[Annotated[bytes, Meta(max_length=64)]] = []
    # Embedding requests: the first prompt position this step computed, how many, and their final hidden states
    # pooled as float32 (the sum of those rows for "mean", the prompt's last row for "last" when it is computed).
    pooled: dict[Handle, tuple[int, int, bytes]] = {}
    # A draft model's proposals (StepPlan.propose) to follow each request's tokens as they are after this step.
    drafts: dict[Handle, list[int]] = {}


class ExecutionMode(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """How plans flow through a world, computed once from its shape (TP, PP) and async scheduling, and read by
    the engine, the scheduler and every worker instead of each deriving it again."""

    plans_in_flight: Annotated[int, Meta(ge=1)] = 1  # plans sent and not yet answered, at most
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


class WorkerHello(Message, tag=int(Kind.HELLO)):
    """A worker introduces itself; the scheduler answers with an Assignment."""

    host: str
    pid: int
    device: str


class Assignment(Message, tag=int(Kind.ASSIGNMENT)):
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
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1)] = 1
    distributed_init: str = ""  # "host:port" of the rendezvous; "" for a world of one
    device: str = ""  # the device the placement chose ("cuda:3", "cpu"); "" leaves it to the worker
    distributed_timeout_s: float = 300.0  # a collective or the rendezvous waiting longer than this fails
    mode: ExecutionMode = ExecutionMode()
    # The world's KV size, fixed when its first world got ready: a replacement allocates exactly this many device
    # and swap blocks, so it fits the scheduler's table. On the first join 0 (-1 for swap) lets the worker size
    # itself from its memory flags.
    num_kv_blocks: Count = 0
    num_swap_blocks: Annotated[int, Meta(ge=-1)] = -1
    # Per-request KV precision: this share of the KV memory holds compact blocks of kv_compact_dtype (0: none);
    # a replacement holds exactly num_compact_blocks of them (0 on the first join).
    kv_compact_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    kv_compact_dtype: str = "int8"
    num_compact_blocks: Count = 0
    quantization: str = "auto"  # the weights' format (proto/quantization.py): auto takes the checkpoint's own
    # Speculative decoding with a draft model (worker_node/draft_model.py): its folder ("" for none), the tokens
    # it proposes per step, and the requests its own KV cache holds at most at full length.
    draft_model: str = ""
    num_speculative_tokens: Count = 0
    draft_max_seqs: Count = 0

    def check(self) -> None:
        """The world's shape must hold together."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp * pp != self.world_size:
            raise WireError(f"world_size {self.world_size} != tensor_parallel_size {tp} x pipeline_parallel_size {pp}")
        if not 0 <= self.rank < self.world_size:
            raise WireError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.world_size > 1 and ":" not in self.distributed_init:
            raise WireError(f"distributed_init must be host:port for a world of {self.world_size}")


class WorkerReady(Message, tag=int(Kind.READY)):
    """The worker loaded its shard and sized its KV cache and swap space."""

    rank: int
    num_kv_blocks: int
    kv_cache_bytes: int
    num_host_blocks: int = 0  # swap space, in blocks
    swap_bytes_per_s: float = 0.0  # measured device ⇄ host copy bandwidth (0: unknown)
    kv_format: str = ""  # what its KV is stored as: bfloat16, int8, fp8_e4m3, ...
    num_compact_blocks: Count = 0  # the compact pool (per-request KV precision), in blocks
    compact_cache_bytes: Count = 0
    compact_format: str = ""
    num_ram_tier_blocks: Count = 0  # KV offload tiers (--kv-offload-ram, --kv-offload-disk-size), in blocks
    num_disk_tier_blocks: Count = 0
    disk_tier_blocks: list[tuple[int, Annotated[bytes, Meta(max_length=64)]]] = []  # (slot, hash) found intact
    kv_address: Annotated[str, Meta(max_length=256)] = ""  # its KV exporter (HOST:PORT), when it serves leases


class Shutdown(Message, tag=int(Kind.SHUTDOWN)):
    reason: str


class Heartbeat(Message, tag=int(Kind.HEARTBEAT)):
    """Sent both ways while a worker is ready. The scheduler's carries its --heartbeat-timeout, so a worker
    knows how long a silent scheduler may stay silent before it is considered gone."""

    rank: int
    seq: int
    # The sender's heartbeat timeout: silence longer than this means the peer is gone (NaN is refused too).
    timeout_s: Annotated[float, Meta(gt=0, lt=1e6)]


class StepError(Message, tag=int(Kind.STEP_ERROR)):
    """A worker could not execute a plan (instead of its StepResult); the worker itself keeps running."""

    step_id: int
    rank: int
    reason: str


class Interrupt(Message, tag=int(Kind.INTERRUPT)):
    """Scheduler to a lone worker: steps first..last, already sent, are not to compute their tokens (a request
    that outranks them arrived). The step running stops at its next layer boundary; each of them still applies
    its diffs and block operations and is answered with an `interrupted` StepResult."""

    first_step_id: int
    last_step_id: int


AnyMessage = Union[
    WorkerHello, Assignment, WorkerReady, StepPlan, StepResult, Shutdown, Heartbeat, StepError, Interrupt
]
_ENCODER = msgspec.msgpack.Encoder()
_FRAME = msgspec.msgpack.Decoder(list[msgspec.Raw])
_VERSION = msgspec.msgpack.Decoder(int)
_MESSAGE = msgspec.msgpack.Decoder(AnyMessage)  # type: ignore[arg-type]


def _kind_of(cls: type[Message]) -> int:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, int), f"{cls.__name__} has no Kind tag"
    return tag


# Each message's kind is its Struct's tag: the table of kinds is read from the union, not written again.
_BY_KIND: dict[int, type[Message]] = {_kind_of(cls): cls for cls in get_args(AnyMessage)}


def encode(message: Message) -> bytes:
    data = _ENCODER.encode((WIRE_VERSION, message))
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return data


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        frame = _FRAME.decode(data)
        version = _VERSION.decode(frame[0]) if frame else None
    except msgspec.MsgspecError as exc:
        raise WireError(f"expected [version, message]: {exc}") from exc
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version!r}, this build speaks {WIRE_VERSION}")
    if len(frame) != 2:
        raise WireError(f"expected [version, message], got {len(frame)} items")
    try:
        message: Message = _MESSAGE.decode(frame[1])
    except msgspec.MsgspecError as exc:
        raise WireError(_explain(exc, frame[1])) from exc
    try:
        message.check()
    except WireError as exc:
        raise WireError(f"malformed {type(message).__name__}: {exc}") from exc
    return message


_PATH = re.compile(r" - at (`key` in )?`\$((?:\[(?:\d+|\.\.\.)\])*)`$")


def _explain(exc: msgspec.MsgspecError, raw: msgspec.Raw) -> str:
    """msgspec's error, its position (`$[3][0][1]`) spelled as field names (`cached_requests[0].new_block_ids`)."""
    text = str(exc)
    try:
        items = msgspec.msgpack.decode(raw, type=list[msgspec.Raw])
        kind = msgspec.msgpack.decode(items[0]) if items else None
    except msgspec.MsgspecError:
        kind = None
    cls = _BY_KIND.get(kind) if type(kind) is int else None
    if cls is None:
        return f"unknown message kind {kind!r}" if type(kind) is int else f"expected [kind, *fields]: {text}"
    match = _PATH.search(text)
    if match is None:
        return f"malformed {cls.__name__}: {text}"
    steps = re.findall(r"\[(\d+|\.\.\.)\]", match.group(2))
    where = _name_path(cls, steps)
    key = " key" if match.group(1) else ""
    return f"malformed {cls.__name__}: {where}{key}: {text[: match.start()]}"


def _name_path(cls: type[Message], steps: list[str]) -> str:
    """Field names along the indices of an error's position, through Structs, lists, tuples and maps."""
    info: Any = msgspec.inspect.type_info(cls)
    out = ""
    top = True  # a message's fields start after its kind
    for step in steps:
        while isinstance(info, msgspec.inspect.UnionType):  # X | None: the non-None one
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
        if isinstance(info, msgspec.inspect.StructType) and step.isdigit():
            index = int(step) - (1 if top else 0)
            top = False
            if not 0 <= index < len(info.fields):
                return out + f"[{step}]"
            out += ("." if out else "") + info.fields[index].name
            info = info.fields[index].type
        elif isinstance(info, msgspec.inspect.ListType):
            out += f"[{step}]"
            info = info.item_type
        elif isinstance(info, msgspec.inspect.TupleType):
            out += f"[{step}]"
            info = info.item_types[int(step)] if step.isdigit() and int(step) < len(info.item_types) else None
        elif isinstance(info, msgspec.inspect.DictType):
            out += "[...]" if step == "..." else f"[{step}]"
            info = info.value_type
        else:
            out += f"[{step}]"
    return out or "message"
