"""The scheduler process's own settings (vllm-scheduler, and vllm-serve for its schedulers): where it listens, how
its world is placed, its operations (liveness, draining, KV events, control), and its OpenAI door."""

from __future__ import annotations

from dataclasses import dataclass

from proto.wire import HEARTBEAT_TIMEOUT_S
from settings.process import TOKEN_ENV
from settings.setting import check, setting

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct, converted once (scheduler_node/engine/model_path.py)
POOLINGS = ("last", "mean")  # how /v1/embeddings pools a prompt's final hidden states
SERVE_OPENAI_PORT = 8000  # vllm-serve's default (vllm-scheduler's is 0: off)


@dataclass(frozen=True, slots=True)
class SchedulerServer:
    """Where the scheduler listens, and the model it serves."""

    model: str = setting(
        DEFAULT_MODEL,
        readers="scheduler",
        help="HF folder (safetensors, or a linked GGUF), a .gguf file, an HF hub id (org/name) already in the local "
        "HF cache, or 'default' (SmolLM2-135M-Instruct)",
    )
    host: str = setting("127.0.0.1", readers="scheduler", help="bind address of gRPC and the HTTP API")
    port: int = setting(50051, low=0, high=65535, readers="scheduler", help="gRPC port")
    worker_host: str = setting(
        "127.0.0.1",
        readers="scheduler",
        help="bind address of the ZMQ socket workers join (vllm-scheduler's default: --host, so that workers on other "
        "hosts reach it where they reach gRPC, as article 003's multi-node lines have it)",
    )
    worker_port: int = setting(
        50061,
        low=0,
        high=65535,
        readers="scheduler",
        help="port of the ZMQ socket workers join (vllm-serve's default is 0: a free port, as its workers are its "
        "own children; with --data-parallel-size, replica i's workers join at this + i)",
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class World:
    """Where the world's ranks go."""

    num_workers: int | None = setting(
        None,
        low=1,
        readers="scheduler",
        help="workers to wait for; derived from TP x PP, kept as a checked alias (it must equal TP x PP)",
    )
    topology: str | None = setting(
        None,
        metavar="FILE.yaml",
        readers="scheduler",
        help="devices, hosts and interconnects (deploy/topology/*.yaml) to place ranks on; default: one "
        "island, ranks in join order, each worker picks its device",
    )
    allow_cross_island: bool = setting(
        False,
        readers="scheduler",
        help="let a tensor-parallel group span slower links when it fits no fast island (else: fail at start)",
    )
    print_placement: bool = setting(
        False,
        readers="scheduler",
        help="print which rank goes on which host and device, and how the stages are linked, then exit",
    )
    distributed_port: int = setting(
        0,
        low=0,
        high=65535,
        readers="scheduler",
        help="port of the torch.distributed rendezvous that rank 0 opens (0: one free on this host; set it "
        "when rank 0 runs on another host)",
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class Operations:
    """Liveness, draining, KV events, control."""

    heartbeat_timeout: float = setting(
        HEARTBEAT_TIMEOUT_S,
        above=0,
        readers="scheduler",
        help="seconds of silence after which a worker is declared lost (and after which a worker whose "
        "scheduler went silent exits); heartbeats go both ways every quarter of it",
    )
    shutdown_timeout: float = setting(
        30.0,
        low=0,
        aliases=("drain_timeout",),
        readers="scheduler",
        help="on SIGTERM/SIGINT: new requests are refused at once (UNAVAILABLE / HTTP 503 with Retry-After) while "
        "running ones get this many seconds to finish; then those left end with UNAVAILABLE ('the server is "
        "shutting down') and the process exits 0 (0: no limit; a second signal ends them at once). The same "
        "drain as Control.Drain; --drain-timeout is its former name",
    )
    exit_after_drain: bool = setting(
        False,
        readers="scheduler",
        help="exit 0 once a Control.Drain answers 'drained' (nothing left running), as after SIGTERM: the "
        "replica of a rolling restart, which vllm-serve starts again (vllm-serve --data-parallel-size turns it on "
        "for its replicas)",
    )
    kv_events_port: int = setting(
        0,
        low=0,
        high=65535,
        readers="scheduler",
        help="publish the prefix cache's block stored/removed events (ZeroMQ PUB, msgpack) on this port for "
        "vllm-router --routing-strategy kv (0: off)",
    )
    kv_events_snapshot_port: int = setting(
        0,
        low=0,
        high=65535,
        readers="scheduler",
        help="port where a late or resynchronizing subscriber asks for every cached block hash (0: "
        "--kv-events-port + 1)",
    )
    kv_events_host: str = setting(
        "127.0.0.1",
        readers="scheduler",
        help="bind address of the KV events sockets (they reveal which prompts were seen: open only to the router)",
    )
    control_token: str = setting(
        "",
        env=TOKEN_ENV,
        readers="scheduler",
        help="Control RPCs need metadata 'authorization: Bearer TOKEN', and the HTTP control routes (POST "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter) the header 'Authorization: Bearer TOKEN', not the API key "
        f"(default: ${TOKEN_ENV}; empty: Control is open, the HTTP routes behind --api-key like every route)",
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class OpenAIApi:
    """The OpenAI-compatible HTTP door."""

    openai_port: int = setting(
        0,
        low=0,
        high=65535,
        readers="scheduler",
        help=f"port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...) on --host "
        f"(0: off; vllm-serve's default is {SERVE_OPENAI_PORT})",
    )
    served_model_name: str = setting(
        "",
        readers="scheduler",
        help="the model name requests give in `model` (gRPC: another name is NOT_FOUND; HTTP: 404), /v1/models lists "
        "and the metrics' model_name label (default: a hub id as given, else the model folder's name)",
    )
    tool_call_parser: str = setting(
        "hermes",
        readers="scheduler",
        help="how tool_choice auto reads tool calls out of the output: hermes, llama3_json "
        "(scheduler_node/api/tool_parsers.py), or module:Class (a subclass of "
        "scheduler_node.api.tool_parsers.ToolParser); required and named choices need none",
    )
    reasoning_parser: str = setting(
        "",
        readers="scheduler",
        help="split the model's <think>...</think> off into reasoning_content: qwen3, deepseek_r1 "
        "(scheduler_node/api/reasoning_parsers.py), or module:Class (a subclass of "
        "scheduler_node.api.reasoning_parsers.ReasoningParser); structured output and required tool calls then "
        "apply to the answer after the reasoning (default: off)",
    )
    embedding_pooling: str = setting(
        "last",
        choices=POOLINGS,
        readers="scheduler",
        help="how POST /v1/embeddings pools a prompt's final hidden states: the last token's (decoder embedding "
        "models: Qwen3-Embedding, e5-mistral) or the mean of all of them; normalized unless normalize: false",
    )

    def __post_init__(self) -> None:
        check(self)


LAUNCHERS = ("local", "ray")  # scheduler_node/engine/launchers.py


@dataclass(frozen=True, slots=True)
class Serve:
    """vllm-serve's replicas and how their workers are started."""

    data_parallel_size: int = setting(
        1,
        low=1,
        readers="serve",
        help="replicas of the model, each its own scheduler and TP x PP world on devices of its own, behind a "
        "vllm-router on --host (gRPC on --grpc-port, HTTP on --port; the replicas listen on loopback)",
    )
    launcher: str = setting(
        "local",
        choices=LAUNCHERS,
        readers="serve",
        help="local: the workers are child processes of vllm-serve on this host; ray: Ray actors in a placement "
        "group of the Ray cluster at --ray-address, each TP group packed on one node",
    )
    ray_address: str | None = setting(
        None,
        readers="serve",
        help="--launcher ray: the Ray cluster to join (HOST:PORT of its GCS, or 'auto'); default: $RAY_ADDRESS, "
        "else a new local Ray instance on this host",
    )

    def __post_init__(self) -> None:
        check(self)
