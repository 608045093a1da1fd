"""A step's messages (proto/wire.py frames them): the scheduler's `StepPlan` with the records it is made of, and the
worker's `StepResult`."""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from proto.multimodal import ImageInput
from proto.wire_base import BlockPair, Count, Handle, Kind, Message, Record, WireError

STRUCTURED_KINDS = ("json", "regex", "choice", "json_object", "lark")

_SWAP = sys.byteorder != "little"  # the wire's int32 arrays are little-endian
assert array.array("i").itemsize == 4, "array('i') must be 32-bit for the wire's int32 arrays"


def pack_int32(values: Iterable[int]) -> bytes:
    """Little-endian int32: a plan's packed decodes, a result's packed tokens."""
    packed = array.array("i", values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _negative(packed: bytes) -> bool:
    """Whether some little-endian int32 of `packed` is negative (its last byte's high bit: a pass in C)."""
    return max(packed[3::4]) >= 0x80


def unpack_int32(data: bytes) -> list[int]:
    packed = array.array("i")
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


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
    slot the scheduler placed it in; a worker whose slot holds another id loads it from the folder first, and
    checks it read the files the scheduler checked (`sha256`)."""

    id: Annotated[int, Meta(ge=1)]
    path: Annotated[str, Meta(max_length=4096)]
    slot: Annotated[int, Meta(ge=0, le=4095)]
    # Adapters evicted from a slot that the workers keep in host memory (least recently used first out), so
    # a reload skips the disk: --max-cpu-loras, the same for every request (the scheduler mirrors the tier).
    host_slots: Annotated[int, Meta(ge=0, le=4096)] = 0
    name: Annotated[str, Meta(max_length=128)] = ""  # its served name: the errors its clients see name it, not its path
    # Its files' checksum when registered (proto/lora.py AdapterFiles.sha256); "": not checked.
    sha256: Annotated[str, Meta(max_length=64)] = ""


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
    images: list[ImageInput] = []  # its images (proto/multimodal.py), sent with every NewRequest of it


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
    # Its one rule (fewer drafts than scheduled tokens) is StepPlan.check's, not a __post_init__: that would be a
    # Python call for every request of every plan, where the plan's check looks at the few with drafts.


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
    # KV offload tier moves, in this order, after the swap-out and before copies and swap-in (core/kv/tier_index.py).
    tier_moves: list[TierMove] = []
    # Per-request KV precision (core/kv/precision.py): block ids from here on are the compact pool's (id - base
    # there); 0: the world keeps no compact pool.
    compact_block_base: Count = 0
    # Disaggregated prefill/decode (worker_node/kv/transfer/exporter.py): leases revoked before anything else runs, KV
    # pulled from another world after the block operations, leases granted after the forward pass.
    kv_revokes: list[Annotated[bytes, Meta(min_length=16, max_length=16)]] = []
    kv_imports: list[KVImport] = []
    kv_grants: list[KVGrant] = []
    # Speculative decoding with a draft model: the requests of this plan whose next tokens the draft proposes
    # once this step's are known (StepResult.drafts).
    propose: list[Handle] = []
    # Steady decodes, most of a plan in steady state: requests the workers hold that compute one token within the
    # blocks they have (no blocks, tokens or proposals to add), packed as little-endian int32 arrays of their
    # handles and computed tokens (`pack_int32`); each is a `CachedRequest(handle, computed, 1)` that is not in
    # `cached_requests`. Two bins: no object per request to build, encode and decode on either side.
    decode_handles: bytes = b""
    decode_computed: bytes = b""

    def check(self) -> None:
        handles, computed = len(self.decode_handles), len(self.decode_computed)
        if handles % 4 or computed != handles:
            raise WireError(
                f"decode_handles ({handles} bytes) and decode_computed ({computed} bytes): one int32 each per request"
            )
        if handles and (_negative(self.decode_handles) or _negative(self.decode_computed)):
            raise WireError("decode_handles and decode_computed: handles and computed tokens are never negative")
        cached = self.cached_requests
        for r in [r for r in cached if r.draft_token_ids]:
            if len(r.draft_token_ids) >= r.num_scheduled_tokens:
                raise WireError(
                    f"cached_requests[{cached.index(r)}].draft_token_ids: {len(r.draft_token_ids)} in request "
                    f"{r.handle}'s {r.num_scheduled_tokens} scheduled tokens (the first must be a known one)"
                )
        for i, m in enumerate(self.tier_moves):
            if m.src_tier == m.dst_tier:
                raise WireError(f"tier_moves[{i}]: tiers must be two different ones of 0, 1, 2, got {m.src_tier}")
        for i, imp in enumerate(self.kv_imports):
            if not len(imp.src) == len(imp.dst) == len(imp.hashes):
                raise WireError(f"kv_imports[{i}]: src, dst and hashes must have one entry per block")

    def decodes(self) -> tuple[list[int], list[int]]:
        """The packed steady decodes: their handles, and their computed tokens."""
        return unpack_int32(self.decode_handles), unpack_int32(self.decode_computed)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_handles) // 4

    @property
    def all_cached_requests(self) -> list[CachedRequest]:
        """`cached_requests`, then the packed decodes as CachedRequests: for readers of a whole plan (stand-in
        workers, tests), not for a step's hot path."""
        return self.cached_requests + [CachedRequest(h, c, 1) for h, c in zip(*self.decodes())]

    @property
    def num_scheduled_tokens(self) -> dict[int, int]:
        """Tokens each request computes this step, by handle: the new requests, the cached ones, the decodes."""
        scheduled = {r.handle: r.num_scheduled_tokens for r in self.new_requests}
        scheduled.update((r.handle, r.num_scheduled_tokens) for r in self.cached_requests)
        scheduled.update(dict.fromkeys(self.decodes()[0], 1))
        return scheduled

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.cached_requests) + self.num_decodes

    @property
    def total_tokens(self) -> int:
        new = sum(r.num_scheduled_tokens for r in self.new_requests)
        return new + sum(r.num_scheduled_tokens for r in self.cached_requests) + self.num_decodes

    @property
    def has_work(self) -> bool:
        """Anything for the workers to do or learn (an empty plan is not sent)."""
        return bool(
            self.new_requests
            or self.cached_requests
            or self.decode_handles
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
    # proposals the accepted ones and the one sampled after them. A step of one token each sends them packed
    # instead (`token_handles`, `tokens`): read both through `sampled_items` and `tokens_of`.
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
    # A step where every request that sampled got one token: the handles and their tokens as little-endian int32
    # arrays (`pack_int32`), instead of `sampled`. Two bins, not a map of lists: a thousand requests' tokens cost
    # the worker and the scheduler microseconds to encode and decode, not a fifth of a millisecond each.
    token_handles: bytes = b""
    tokens: bytes = b""
    # Requests whose own computation failed this step (their logits were not finite), with why: each fails alone,
    # its tokens above ignored; every other request of the step is unaffected (a row never reaches another).
    faulted: dict[Handle, Annotated[str, Meta(max_length=1024)]] = {}

    def check(self) -> None:
        handles, tokens = len(self.token_handles), len(self.tokens)
        if handles % 4 or tokens != handles:
            raise WireError(f"token_handles ({handles} bytes) and tokens ({tokens} bytes): one int32 each per request")
        if tokens and self.sampled:
            raise WireError("sampled and tokens: a result carries its tokens one way, not both")

    def sampled_items(self) -> Iterable[tuple[int, list[int]]]:
        """Each request that sampled, with its tokens (as `sampled.items()`, whichever way they travelled)."""
        if not self.tokens:
            return self.sampled.items()
        return zip(unpack_int32(self.token_handles), [[t] for t in unpack_int32(self.tokens)])

    def tokens_of(self, handle: int) -> list[int] | None:
        """One request's tokens (None if it did not sample): for the few a caller asks about, not the many."""
        if not self.tokens:
            return self.sampled.get(handle)
        handles = unpack_int32(self.token_handles)
        return [unpack_int32(self.tokens)[handles.index(handle)]] if handle in handles else None
