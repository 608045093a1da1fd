"""The settings of the client-side commands: vllm-client, vllm-monitor and vllm-convert (vllm-bench's are
settings/bench.py's)."""

from __future__ import annotations

from dataclasses import dataclass

from settings.process import TOKEN_ENV
from settings.setting import check, setting
from settings.units import parse_duration

DEFAULT_MAX_TOKENS = 256
CLIENT, MONITOR, CONVERT = "client", "monitor", "convert"


@dataclass(frozen=True, slots=True)
class ClientConnection:
    """The server vllm-client talks to."""

    host: str = setting("127.0.0.1", readers=CLIENT, help="server address")
    port: int = setting(50051, readers=CLIENT, help="server gRPC port")
    timeout: float = setting(600.0, readers=CLIENT, help="seconds before giving up")
    tls: bool = setting(False, readers=CLIENT, help="connect with TLS, trusting the system's root certificates")
    tls_ca: str | None = setting(
        None, metavar="PEM", readers=CLIENT, help="connect with TLS, trusting this CA (implies --tls)"
    )
    tls_server_name: str | None = setting(
        None, readers=CLIENT, help="the name the server's certificate must carry (default: --host)"
    )
    control_token: str = setting(
        "",
        env=TOKEN_ENV,
        readers=CLIENT,
        help=f"bearer token for Control RPCs such as `stats` (default: ${TOKEN_ENV})",
    )
    wait_ready: float = setting(
        0.0,
        metavar="SECONDS",
        readers=CLIENT,
        help="first wait up to this long for the server to report SERVING (health check)",
    )


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """What vllm-client asks for."""

    chat: bool | None = setting(
        None,
        readers=CLIENT,
        help="--chat: send the prompt as one user message through the chat template (an error if the model has "
        "none); --no-chat: send it as raw text to complete; default: the chat template when the model has one",
    )
    model: str = setting("", readers=CLIENT, help="the model to ask for (a vllm-router routes by it; '': the default)")
    max_tokens: int = setting(
        DEFAULT_MAX_TOKENS,
        readers=CLIENT,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}; the server allows up to the context end)",
    )
    temperature: float | None = setting(None, readers=CLIENT, help="0 for greedy (server default 1.0)")
    top_p: float | None = setting(None, readers=CLIENT, help="nucleus sampling mass in (0, 1]")
    top_k: int | None = setting(None, readers=CLIENT, help="sample from the k most likely tokens (-1: off)")
    seed: int | None = setting(None, readers=CLIENT, help="per-request seed for reproducible sampling")
    stop: tuple[str, ...] = setting((), repeat="append", readers=CLIENT, help="stop string (repeatable)")
    n: int | None = setting(None, readers=CLIENT, help="sequences to sample")
    ignore_eos: bool = setting(False, readers=CLIENT, help="keep generating past end-of-sequence")
    request_id: str = setting("", readers=CLIENT, help="request id (default: assigned by the server)")


@dataclass(frozen=True, slots=True)
class ClientModes:
    """vllm-client's other modes: drain and health."""

    migrate: bool = setting(
        False,
        readers=CLIENT,
        help="`vllm-client drain`: hand the requests that came through vllm-router back to it at once (it resumes "
        "them on another replica: live migration); the others still run to their end",
    )
    health_service: str = setting(
        "",
        readers=CLIENT,
        help="`vllm-client health`: the grpc.health.v1 service to check ('': the whole server, ready to serve; "
        "minivllm.liveness: the scheduler answers)",
    )


@dataclass(frozen=True, slots=True)
class Monitor:
    """What vllm-monitor scrapes, and how often."""

    metric: tuple[str, ...] = setting(
        (),
        repeat="append",
        required=True,
        readers=MONITOR,
        help="metric name (repeatable), or one of cache_hit_rate, memory_usage, fragmentation, spec_decode "
        "(clients/monitor.py ALIASES): what they stand for is printed",
    )
    interval: float = setting(
        1.0, above=0, parse=parse_duration, readers=MONITOR, help="seconds between scrapes (or a duration: 500ms)"
    )
    host: str = setting("127.0.0.1", readers=MONITOR, help="the scheduler's --metrics-host")
    metrics_port: int = setting(8000, readers=MONITOR, help="the scheduler's --metrics-port")
    url: str = setting("", readers=MONITOR, help="the full endpoint URL (overrides --host and --metrics-port)")
    count: int = setting(0, readers=MONITOR, help="stop after this many scrapes (0: until Ctrl-C)")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class Convert:
    """What vllm-convert reads and writes."""

    input: str = setting(
        "", required=True, readers=CONVERT, help="the .gguf file (or, with --quantization awq, an HF folder)"
    )
    output: str = setting("", required=True, readers=CONVERT, help="the folder to write (must not exist yet)")
    link: bool = setting(
        False,
        readers=CONVERT,
        help="keep the weights in the GGUF file (linked from the folder), dequantised at each load",
    )
    quantization: str = setting(
        "none",
        choices=("none", "awq"),
        readers=CONVERT,
        help="awq: 4-bit AWQ with activation-aware scales searched on a calibration text (AutoAWQ GEMM layout)",
    )
    group_size: int | None = setting(
        None,
        readers=CONVERT,
        help="AWQ: input channels per scale (32, 64 or 128; default the largest that splits every projection)",
    )
    calib_file: str | None = setting(
        None, readers=CONVERT, help="AWQ: a text file to calibrate on (default: a built-in sample)"
    )
