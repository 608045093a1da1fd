"""The settings tree's index: which groups each console script takes (its flags, --help sections and config keys),
and the defaults it changes. Its parsers, docs/settings.md and the tests read it; what `LLM(...)` takes is
settings/engine_args.py's EngineSettings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from settings.bench import BenchLoad, BenchOutput, BenchTarget, BenchWorkload
from settings.cli import CommandParser, Part, Spelling, add_settings
from settings.config_file import add_config_flag
from settings.engine import EngineConfig
from settings.process import ApiKey, Logging, MetricsEndpoint, Tls
from settings.router import Replicas, RouterServer, Routing
from settings.server import DEFAULT_MODEL, SERVE_OPENAI_PORT, OpenAIApi, Operations, SchedulerServer, Serve, World
from settings.tools import ClientConnection, ClientModes, ClientRequest, Convert, Monitor
from settings.topology import CrossDevice
from settings.worker import HANDED_ON, WorkerOptions


@dataclass(frozen=True, slots=True)
class Command:
    """A console script: its groups, and the defaults it changes (by setting name)."""

    parts: tuple[Part, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    spellings: Mapping[str, Spelling] = field(default_factory=dict)  # its own flags for a setting, by name


SCHEDULER = (
    Part(SchedulerServer),
    Part(EngineConfig),
    Part(World),
    Part(Operations),
    Part(WorkerOptions, only=("zmq_curve_dir",)),
    Part(Tls),
    Part(MetricsEndpoint),
    Part(OpenAIApi),
    Part(ApiKey),
    Part(Logging),
)
# What a worker may say it serves: the scheduler's own settings of the model and the world's shape.
WORLD_OF_A_WORKER = (
    Part(SchedulerServer, only=("model",)),
    Part(EngineConfig, only=("tensor_parallel_size", "pipeline_parallel_size")),
)
WORKER_MODEL_NOTE = (
    "vllm-worker: default none, it serves what the scheduler assigns; with --model, it also says "
    "--tensor-parallel-size and --pipeline-parallel-size, which a scheduler without --model takes from the first "
    "worker and every other worker must agree with (else it is refused, naming what disagrees)"
)
COMMANDS: dict[str, Command] = {
    # Without --model, the model and the world's shape come from the first worker that names them (article 003's
    # multi-node lines: `vllm-scheduler --host H --port 50051`, then `vllm-worker --model M ...` on each node).
    "vllm-scheduler": Command(
        SCHEDULER,
        {"model": "", "worker_host": ""},  # "": --host's (scheduler_node/cli/scheduler.py)
        {
            "model": Spelling(
                ("--model",), f"vllm-scheduler: default none, the first worker's --model, else {DEFAULT_MODEL}"
            )
        },
    ),
    # A worker may say what it serves (article 003: `vllm-worker --model M --scheduler-address H:50051
    # --tensor-parallel-size 2 --pipeline-parallel-size 2`): a world's workers must agree with it, or are refused.
    "vllm-worker": Command(
        (Part(WorkerOptions), *WORLD_OF_A_WORKER, Part(Logging)),
        {"model": ""},
        {"model": Spelling(("--model",), WORKER_MODEL_NOTE)},
    ),
    # Its children: a scheduler per replica (the scheduler's settings), their workers (a worker's, but where to
    # join), and with --data-parallel-size a router in front (its routing settings).
    "vllm-serve": Command(
        (*SCHEDULER, *HANDED_ON, Part(Serve), Part(Routing), Part(CrossDevice)),
        {"openai_port": SERVE_OPENAI_PORT, "worker_port": 0},  # 0: a free port (its workers are its children)
        # As vLLM's `vllm serve`: --port is the HTTP (OpenAI) port; gRPC moves to --grpc-port. Its schedulers are
        # still handed --port (gRPC) and --openai-port: the names are vllm-serve's alone.
        {
            "openai_port": Spelling(
                ("--port", "--openai-port"), "vllm-serve: --port, as in vLLM; --openai-port is its former name"
            ),
            "port": Spelling(("--grpc-port",), "vllm-serve: --grpc-port (--port is the HTTP port here)"),
        },
    ),
    "vllm-router": Command(
        (
            Part(RouterServer),
            Part(Replicas),
            Part(Routing),
            Part(CrossDevice, only=("memory_sharing",)),
            Part(ApiKey),
            Part(Tls),
            Part(MetricsEndpoint),
            Part(Logging),
        )
    ),  # fmt: skip
    "vllm-client": Command((Part(ClientConnection), Part(ClientRequest), Part(ClientModes))),
    "vllm-monitor": Command((Part(Monitor),)),
    "vllm-bench": Command(
        (Part(BenchTarget), Part(BenchWorkload), Part(BenchLoad), Part(BenchOutput), Part(Logging)),
        {"log_level": "WARNING"},
    ),
    "vllm-convert": Command((Part(Convert), Part(Logging))),
}


# Console scripts that are another name of a command (pyproject.toml points them at its entry): article 003 starts
# the server as `vllm-serving`.
SCRIPT_ALIASES = {"vllm-serving": "vllm-serve"}


def command_parser(prog: str, description: str, **options: Any) -> CommandParser:
    """A command's parser: --config, then a section of flags per group of its settings; parsing checks each group
    (a command that reads its settings off the namespace still gets every group's checks)."""
    command = COMMANDS[prog]
    parser = CommandParser(prog=prog, description=description, parts=command.parts, **options)
    add_config_flag(parser)
    add_settings(parser, command.parts, command.defaults, command.spellings)
    return parser
