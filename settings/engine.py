"""The engine's settings, the root of the tree vllm-scheduler and `LLM` build an engine core from: the model's
precision, the world's shape, the request order, the loop's deadlines, and the groups of the scheduler, the KV
precision and LoRA."""

from __future__ import annotations

from dataclasses import dataclass

from proto.parallel import ParallelLayout
from proto.quantization import QUANTIZATIONS
from proto.wire import WORKER_JOIN_TIMEOUT_S, ExecutionMode
from settings.kv_compact import CompactKV
from settings.lora import LoraConfig
from settings.multimodal import MultiModalConfig
from settings.priority import PriorityConfig
from settings.scheduler import BOTH, SchedulerConfig
from settings.setting import check, group, setting
from settings.units import parse_duration

DTYPES = ("auto", "float32", "bfloat16", "float16")
AGING_INTERVAL_S = 10.0  # seconds of age worth one priority point (dynamic, hybrid)
PREEMPTION_MARGIN = 5.0  # priority points a request must beat another by to displace it
# A step's deadline grows with its work: a long prefill on a slow CPU may take this much per token.
STEP_SECONDS_PER_TOKEN = 0.02


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """The engine loop: its deadlines, its queue's bound, its batching delay; what its doors take as a priority."""

    rejoin_timeout: float = setting(
        60.0,
        name="worker_rejoin_timeout",
        above=0,
        readers="scheduler",
        help="seconds to wait for a replacement of a lost worker before failing its requests with UNAVAILABLE",
    )
    max_waiting_requests: int = setting(
        0,
        low=0,
        readers="scheduler",
        help="waiting sequences at most; beyond it new requests get RESOURCE_EXHAUSTED at once (0: unbounded)",
    )
    scheduler_delay: float = setting(
        0.0,
        low=0,
        parse=parse_duration,
        aliases=("scheduler_interval",),
        readers="scheduler",
        help="seconds to wait for more arrivals before starting a small batch (0: never wait), or a duration with "
        "its unit (50ms, 0.05s); --scheduler-interval is article 000's name for it",
    )
    step_timeout: float = setting(
        60.0,
        above=0,
        readers="scheduler",
        help=f"seconds a step may run on the workers, plus {STEP_SECONDS_PER_TOKEN * 1000:g} ms per token it computes, "
        "before the ranks that owe its answer are declared lost (a hung step; the usual recovery follows)",
    )
    schedule_gc: bool = setting(
        False,
        flag=False,
        readers="scheduler",
        help="keep the garbage collector's pauses out of the steps (scheduler_node/engine/collector.py); the "
        "servers and LLM turn it on (settings/build.py SERVING), engines built bare (tests) leave it off",
    )
    idle_collection_delay_s: float = setting(
        1.0,
        low=0,
        flag=False,
        readers="scheduler",
        help="with schedule_gc: seconds the engine stays idle before the idle full collection runs (at once, its "
        "tens of milliseconds would be the wait of a client's next request whenever it sends one after another)",
    )
    output_thread: bool = setting(
        True,
        flag=False,
        readers="scheduler",
        help="detokenize and stream on a thread of the output side's own (scheduler_node/engine/output_thread.py), "
        "off the loop's",
    )
    priorities: PriorityConfig = group(PriorityConfig)  # the default and the named ranges (settings/priority.py)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine: model precision, the world's shape, request order."""

    dtype: str = setting(
        "auto",
        choices=DTYPES,
        readers=BOTH,
        help="model dtype on the workers (auto: bfloat16 on GPU and on CPUs with AVX-512 BF16 or AMX, float32 on "
        "other CPUs)",
    )
    scheduler: SchedulerConfig = group(SchedulerConfig)
    tensor_parallel_size: int = setting(
        1, low=1, readers=BOTH, help="workers that split every layer (heads, MLP, vocab) and all-reduce after each"
    )
    pipeline_parallel_size: int = setting(
        1,
        low=1,
        readers=BOTH,
        help="pipeline stages, each holding a contiguous slice of the layers; the world is TP x PP workers",
    )
    async_scheduling: bool = setting(
        True,
        readers="scheduler",
        help="build and send plan N+1 while the workers run step N; with P pipeline stages, keep P plans on "
        "disjoint requests in flight (--no-async-scheduling: one at a time)",
    )
    scheduling_policy: str = setting(
        "fcfs",
        readers="scheduler",
        help="request order: fcfs, priority, dynamic, hybrid (scheduler_node/core/policy.py), or module:Class for "
        "your own Policy subclass",
    )
    aging_interval: float = setting(
        AGING_INTERVAL_S,
        above=0,
        readers="scheduler",
        help="dynamic/hybrid: seconds of age worth one priority point (bounds starvation, see policy.py)",
    )
    preemption_margin: float = setting(
        PREEMPTION_MARGIN,
        readers="scheduler",
        help="priority points a waiting request must beat a running one by to displace it (hysteresis)",
    )
    enable_preemption: bool = setting(
        True,
        readers="scheduler",
        help="a waiting request may displace a running one that it outranks by --preemption-margin (with a "
        "policy that ranks by priority: priority, dynamic, hybrid); --no-enable-preemption: never. Requests are "
        "still preempted when KV blocks run out, which no setting avoids (--preemption-mode says how)",
    )
    options: EngineOptions = group(EngineOptions)
    num_kv_blocks: int = setting(
        0,
        low=0,
        readers=BOTH,
        help="KV blocks every worker holds (0: as many as its --kv-cache-memory / --gpu-memory-utilization "
        "allows; the smallest rank's count becomes the world's, and replacements are told to hold exactly it)",
    )
    num_swap_blocks: int = setting(
        -1,
        low=-1,
        readers=BOTH,
        help="swapped-out KV blocks every worker holds at most (-1: as many as its --swap-space allows)",
    )
    distributed_timeout: float = setting(
        300.0,
        above=0,
        readers=BOTH,
        help="seconds the rendezvous or any collective may wait for a peer rank before failing",
    )
    worker_join_timeout: float = setting(
        WORKER_JOIN_TIMEOUT_S,
        above=0,
        readers="scheduler",
        help="seconds to wait for all workers (a worker still loading after this long gives its rank back)",
    )
    kv_compact: CompactKV = group(CompactKV)
    quantization: str = setting(
        "auto",
        choices=QUANTIZATIONS,
        readers=BOTH,
        help="the weights' format: auto (a quantized checkpoint's own, else none), none (the model dtype), int8 "
        "(per-output-channel int8, quantized on load), fp8 (e4m3, quantized on load or an fp8 checkpoint), awq "
        "(an AutoAWQ 4-bit checkpoint); a flag that contradicts the checkpoint's quantization_config is refused",
    )
    multimodal: MultiModalConfig = group(MultiModalConfig)
    lora: LoraConfig = group(LoraConfig)

    def __post_init__(self) -> None:
        check(self)

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def displacement_margin(self) -> float:
        """The priority points a waiting request must win by to displace a running one; 0 (never) without
        enable_preemption."""
        return self.preemption_margin if self.enable_preemption else 0.0

    @property
    def mode(self) -> ExecutionMode:
        return ExecutionMode.for_world(self.tensor_parallel_size, self.pipeline_parallel_size, self.async_scheduling)
