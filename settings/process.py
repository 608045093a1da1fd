"""Settings several server processes share, each written once: logging, TLS, the metrics endpoint, the HTTP API's
key."""

from __future__ import annotations

from dataclasses import dataclass

from settings.setting import check, setting

API_KEY_ENV = "MINIVLLM_API_KEY"
TOKEN_ENV = "MINIVLLM_CONTROL_TOKEN"
SERVERS = ("scheduler", "router")


@dataclass(frozen=True, slots=True)
class Logging:
    """Logging."""

    log_level: str = setting(
        "INFO",
        readers=("scheduler", "worker", "router", "serve", "bench", "convert"),
        help="DEBUG, INFO, WARNING, ERROR",
    )


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS of the gRPC door."""

    tls_cert: str | None = setting(
        None, metavar="PEM", readers=SERVERS, help="serve gRPC over TLS with this certificate chain"
    )
    tls_key: str | None = setting(None, metavar="PEM", readers=SERVERS, help="the private key of --tls-cert")

    def __post_init__(self) -> None:
        check(self)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """The Prometheus endpoint."""

    metrics_port: int = setting(
        0, low=0, high=65535, readers=SERVERS, help="port of the Prometheus /metrics endpoint (0: off)"
    )
    metrics_host: str = setting("127.0.0.1", readers=SERVERS, help="bind address of the Prometheus endpoint")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """The HTTP API's key."""

    api_key: str = setting(
        "",
        env=API_KEY_ENV,
        readers=SERVERS,
        help=f"HTTP API requests need 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; empty: open; /health "
        "and /metrics stay open)",
    )
