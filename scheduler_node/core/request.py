"""A request's state on the scheduler: WAITING → RUNNING ⇄ PREEMPTED → FINISHED(stop|length|abort|error)."""

from __future__ import annotations

import array
import enum
import itertools
import time
from dataclasses import dataclass, field

from proto.multimodal import ImageInput
from proto.wire import LoraAdapter, NewRequest, SamplingOptions, TokenLogprobs
from scheduler_node.core.kv.block_ops import BlockHash, hash_block
from scheduler_node.core.kv.leases import KVSource
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.speculative import SpecState


class FinishReason(enum.StrEnum):
    """Why a sequence ended: what every door reports as its finish_reason, and the label of the request metrics."""

    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by its client (or the client went away)
    ERROR = "error"  # failed by the engine: its last delta carries the EngineError (engine/outputs.py)
    MIGRATED = "migrated"  # moved off a draining replica: its last delta carries its state (core/migration.py)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = FinishReason.STOP
    FINISHED_LENGTH = FinishReason.LENGTH
    FINISHED_ABORTED = FinishReason.ABORT
    FINISHED_ERROR = FinishReason.ERROR
    FINISHED_MIGRATED = FinishReason.MIGRATED  # handed to another replica (Drain with migrate)

    @property
    def finished(self) -> bool:
        return self not in _LIVE  # identity tests: asked for every request at every step

    @property
    def finish_reason(self) -> FinishReason:
        """Why a finished request ended."""
        if not isinstance(self.value, FinishReason):
            raise ValueError(f"a {self.value} request has not finished")
        return self.value


_LIVE = (Status.WAITING, Status.RUNNING, Status.PREEMPTED)


@dataclass(frozen=True, slots=True)
class StopConditions:
    """What ends a sequence: the one finish rule. `Request.append_tokens` applies it to each sampled token; the
    output side applies `may_stop` to stop strings (text/detokenizer.py) and reports one to `Scheduler.finish`."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()  # the request's own, besides eos
    min_tokens: int = 0  # a stop token or string ends the output only after this many tokens
    ending: frozenset[int] = field(init=False)  # eos and the request's own: one lookup per sampled token

    def __post_init__(self) -> None:
        object.__setattr__(self, "ending", self.eos_token_ids | self.stop_token_ids)

    def may_stop(self, num_output_tokens: int) -> bool:
        """A stop token or string ends the output only past min_tokens (the worker bans stop tokens before; the
        rule holds here for a token that gets through anyway)."""
        return num_output_tokens > self.min_tokens

    def end_of(self, token: int, num_output_tokens: int, room: int) -> Status | None:
        """How the output ends at this token, if it does: a stop token (stop), or max_tokens or `room` (the
        output's share of max_model_len) reached (length)."""
        if token in self.ending and self.may_stop(num_output_tokens):
            return Status.FINISHED_STOPPED
        if num_output_tokens >= self.max_tokens or num_output_tokens >= room:
            return Status.FINISHED_LENGTH
        return None


_arrivals = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stop: StopConditions
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrivals))  # breaks arrival-time ties
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is (or, once this step runs, will be) in the cache
    status: Status = Status.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first start found cached (device and offload tiers)
    cache_salt: str = ""
    block_hashes: list[BlockHash] = field(default_factory=list)  # of every full block of tokens
    swapped: bool = False  # preempted with its KV on the workers' host memory
    num_placeholders: int = 0  # tokens being sampled in steps whose results have not come back
    forks: tuple[Request, ...] = ()  # n > 1: siblings started once the prompt is computed
    # With prompt_logprobs: entry i is prompt token i + 1's (the first token has none), gathered chunk by chunk.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pooled: list[float] | None = None  # an embedding request: its pooled final hidden states so far
    pooled_upto: int = 0  # the prompt positions in `pooled`
    stopped_by_token: bool = False  # ended by eos or a stop token (its text is not part of the output)
    handle: int = -1  # the request's id on the wire, assigned by the scheduler when the request is added
    kv_precision: str = "auto"  # auto | full | compact: the format of its KV blocks (core/kv/precision.py)
    lora: LoraRef | None = None  # its LoRA adapter (None: the base model)
    # Speculative decoding (core/speculative.py): None when it never speculates (opted out, or options the worker
    # cannot verify exactly); the scheduler sets it at admission when speculation is on.
    spec: SpecState | None = None
    # Disaggregated prefill/decode (core/kv/leases.py): a producer's lease on its prompt blocks (b"": none), or
    # where a consumer pulls its prompt's KV from (used once, at its first start).
    kv_lease: bytes = b""
    kv_source: KVSource | None = None
    # Live migration: resumed here from another replica (counted at its first start), and then whether it was
    # counted as importing its KV (a pull that fails moves it to the recomputed count).
    migrated_in: bool = False
    migration_imports: bool = False
    # A migrated sequence that claimed its blocks on arrival while it waits for a seat: its KV import is in a plan
    # whose result is not back (it starts only after: a pull that failed must not be read).
    pulling: bool = False
    # Its images (proto/multimodal.py): each one's placeholder tokens in the prompt, pixels for the workers' encoder.
    images: tuple[ImageInput, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def image_bytes(self) -> int:
        """Its images' pixel values: what a NewRequest of it carries besides tokens."""
        return sum(len(image.pixels) for image in self.images)

    @property
    def num_tokens_at_most(self) -> int:
        """Its prompt and every token it may generate."""
        return len(self.prompt_token_ids) + self.stop.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status not in _LIVE

    def tokens_to_schedule(self) -> int:
        """Tokens to compute: up to the known ones plus the sampled ones still in flight (async scheduling), never
        past max_tokens. (The scheduler's running pass has it inline: core/running_pass.py.)"""
        num_output = len(self.output_token_ids)
        if num_output + self.num_placeholders >= self.stop.max_tokens:
            return 0
        return len(self.prompt_token_ids) + num_output + self.num_placeholders - self.num_computed_tokens

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hash the blocks that filled with tokens (computed or not) since the last call; return all the hashes."""
        hashes = self.block_hashes
        for i in range(len(hashes), self.num_tokens // block_size):
            chunk = self.token_slice(i * block_size, (i + 1) * block_size)
            seen = image_hashes(self.images, i * block_size, (i + 1) * block_size) if self.images else b""
            hashes.append(hash_block(hashes[-1] if hashes else None, chunk, self.cache_salt, seen))
        return hashes

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_tokens(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """Append sampled tokens up to the one that ends the output (`StopConditions.end_of`); return the ones
        kept, and set the status when it ended."""
        output, stop = self.output_token_ids, self.stop
        room = max_model_len - len(self.prompt_token_ids)
        limit, ending = min(stop.max_tokens, room), stop.ending
        if len(output) + len(token_ids) < limit and ending.isdisjoint(token_ids):
            output += token_ids  # the common case, every request at every step: none of them may end it
            return token_ids
        for i, token in enumerate(token_ids):
            output.append(token)
            if len(output) < limit and token not in ending:
                continue  # a token that does not end it: what end_of would say, cheaper
            end = stop.end_of(token, len(output), room)
            if end is not None:
                self.status = end
                self.stopped_by_token = end is Status.FINISHED_STOPPED
                return token_ids[: i + 1]
        return token_ids

    def add_prompt_logprobs(self, first: int, logprobs: list[TokenLogprobs]) -> None:
        """A chunk's prompt logprobs, from prompt position `first` on. A recomputed chunk (after preemption) brings
        positions already held: only the new ones are kept."""
        held = len(self.prompt_logprobs) + 1  # the next position wanted
        if first <= held < first + len(logprobs):
            self.prompt_logprobs.extend(logprobs[held - first :])

    def add_pooled(self, first: int, count: int, data: bytes) -> None:
        """A step's pooled hidden states (proto/wire.py StepResult.pooled): the last row replaces, a chunk's sum
        adds to the chunks before it; a recomputed prompt (after preemption) starts the sum again."""
        values = array.array("f")
        values.frombytes(data)
        if self.sampling.pooling == "last" or first == 0:
            self.pooled = values.tolist()
        elif first == self.pooled_upto and self.pooled is not None:
            self.pooled = [a + b for a, b in zip(self.pooled, values)]
        else:
            return  # rows pooled already
        self.pooled_upto = first + count

    def embedding(self) -> list[float] | None:
        """The pooled prompt (None until every prompt token is pooled)."""
        if self.pooled is None or self.pooled_upto < len(self.prompt_token_ids):
            return None
        if self.sampling.pooling == "mean":
            return [v / self.pooled_upto for v in self.pooled]
        return self.pooled

    @property
    def prompt_logprobs_done(self) -> bool:
        return len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1

    def to_new_request(
        self, block_ids: list[int], num_scheduled_tokens: int, lora: LoraAdapter | None = None
    ) -> NewRequest:
        return NewRequest(
            self.handle,
            list(self.prompt_token_ids),
            list(self.output_token_ids),
            self.sampling,
            list(block_ids),
            self.num_computed_tokens,
            num_scheduled_tokens,
            lora,
            list(self.images),
        )


def image_hashes(images: tuple[ImageInput, ...], start: int, end: int) -> bytes:
    """The content hashes of the images whose placeholder tokens lie in [start, end): what a block covering them
    holds besides its tokens (the same placeholders stand for every image)."""
    return b"".join(image.hash for image in images if image.offset < end and image.end > start)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A validated request as a door submits it to the engine (n sequences share its prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    n: int
    priority: int
    cache_salt: str = ""
    stop_token_ids: list[int] = field(default_factory=list)  # besides eos: tokens that end the output
    kv_precision: str = "auto"  # auto | full | compact (core/kv/precision.py)
    lora: LoraRef | None = None  # the LoRA adapter it runs with (None: the base model)
    speculate: bool = True  # False: never speculative decoding for this request (when the server has it on)
    migratable: bool = False  # its door takes a "migrated" end (vllm-router): a Drain(migrate) moves it
    resume: tuple[SequenceResume, ...] = ()  # a migrated request: only these sequences run, from where they stopped
    # Disaggregated prefill/decode (core/kv/leases.py): hold the prompt's KV under a lease when it ends (a
    # prefill replica), or pull it from another replica's lease (a decode replica).
    kv_produce: bool = False
    kv_source: KVSource | None = None
    images: tuple[ImageInput, ...] = ()  # its images, their placeholders in prompt_token_ids (proto/multimodal.py)
