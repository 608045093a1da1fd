"""A worker's session with the scheduler outside the steps (proto/wire.py frames them): the hand-shake (`WorkerHello`,
`Assignment`, `WorkerReady`), liveness (`Heartbeat`), failures (`StepError`), `Interrupt` and `Shutdown`."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from proto.wire_base import Count, Handle, Kind, Message, WireError


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


# The gRPC method, on the scheduler's gRPC port, that answers where workers join (their ZeroMQ socket's HOST:PORT,
# as UTF-8 bytes; the request is empty): a worker given the scheduler's gRPC address asks it there, over a bare
# HTTP/2 exchange of its own (worker_node/join_address.py: a worker never imports grpc). A wildcard host (0.0.0.0)
# stands for the address the worker asked at.
WORKER_JOIN_PATH = "/minivllm.v1.WorkerJoin/Endpoint"


class WorkerHello(Message, tag=int(Kind.HELLO)):
    """A worker introduces itself; the scheduler answers with an Assignment, or with a refusing Shutdown.

    A worker started with --model also says what it serves: the model as given, and the world's shape. A scheduler
    started without --model takes them from the first such worker; a worker whose model or shape disagrees with
    the world's is refused, by name. "" and 0: the worker did not say (it serves what it is assigned)."""

    host: str
    pid: int
    device: str
    model: Annotated[str, Meta(max_length=4096)] = ""
    tensor_parallel_size: Annotated[int, Meta(ge=0, le=65536)] = 0
    pipeline_parallel_size: Annotated[int, Meta(ge=0, le=65536)] = 0


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
    extra_modules: list[str] = []  # a multimodal checkpoint's modules to load besides the decoder (proto/multimodal.py)
    # Speculative decoding with a draft model (worker_node/draft_model.py): its folder ("" for none), the tokens
    # it proposes per step, and the requests its own KV cache holds at most at full length.
    draft_model: str = ""
    num_speculative_tokens: Count = 0
    draft_max_seqs: Count = 0
    # LoRA (--enable-lora): the adapter slots (--max-loras; 0: LoRA off) and the largest rank (--max-lora-rank). A
    # worker that captures decode graphs preallocates its slots from them (worker_node/lora/slot_bank.py).
    max_loras: Annotated[int, Meta(ge=0, le=4096)] = 0
    max_lora_rank: Count = 0

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
    # The worker was refused for what it is (its model or the world's shape disagree): starting it again as it is
    # cannot help, so it exits with the bad-flags status and its supervisor does not restart it.
    refused: bool = False


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
    # The requests whose own inputs made the plan fail (an adapter that cannot be read, a grammar that cannot be
    # compiled): they fail alone and the others are recomputed. Empty: the worker cannot tell whose fault it was.
    handles: list[Handle] = []
    # LoRA adapters (ids) the worker cannot use: the engine refuses later requests naming them (they are loaded again
    # under a new id).
    adapters: list[Annotated[int, Meta(ge=1)]] = []


class Interrupt(Message, tag=int(Kind.INTERRUPT)):
    """Scheduler to a lone worker: steps first..last, already sent, are not to compute their tokens (a request
    that outranks them arrived). The step running stops at its next layer boundary; each of them still applies
    its diffs and block operations and is answered with an `interrupted` StepResult."""

    first_step_id: int
    last_step_id: int
