"""vllm-router's settings (and the routing flags vllm-serve shares for --data-parallel-size), with the --replica
setting's value: a scheduler to route to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from settings.process import API_KEY_ENV, TOKEN_ENV
from settings.setting import check, setting
from settings.worker import KV_ROLES

# `prefix`: a replica may take up to 1.5 x its share of the open streams. The bounded-loads paper's 1.25 spills
# too often when few streams are open (with 2 replicas and 8 streams, a sixth on one replica already overflows):
# in scripts/bench_router.py it lost a fifth of the hit rate that 1.5 keeps.
DEFAULT_LOAD_FACTOR = 1.5
DEFAULT_OVERLAP_WEIGHT = 4.0  # router_node/kv_strategy.py
DEFAULT_MIN_PROMPT_TOKENS = 64  # router_node/disaggregate.py
ROUTER = "router"


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One --replica: a scheduler the router forwards to."""

    address: str  # HOST:PORT of the scheduler's gRPC server
    model: str  # the name it serves (its --served-model-name)
    weight: float = 1.0  # its share relative to the other replicas of its model (capacity)
    http: str = ""  # HOST:PORT of its OpenAI HTTP API (its --openai-port), where the router's HTTP door forwards
    kv_events: str = ""  # HOST:PORT of its KV events (its --kv-events-port), for --routing-strategy kv
    kv_snapshot: str = ""  # HOST:PORT of its KV snapshots (its --kv-events-snapshot-port; default: kv_events + 1)
    tokenizer: str = ""  # the model's folder (tokenizer.json, chat template): kv hashes text prompts like it
    kv_role: str = "both"  # prefill, decode or both (its vllm-serve --kv-role), for --disaggregate

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_role", self.kv_role or "both")
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"replica {self.address}: kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}"
            )
        for key in ("address", "http", "kv_events", "kv_snapshot"):
            address = getattr(self, key)
            host, _, port = address.rpartition(":")
            if (address or key == "address") and (not host or not port.isdigit() or not 0 < int(port) < 65536):
                raise ValueError(f"replica {key} must be HOST:PORT, got {address!r}")
        if self.kv_snapshot and not self.kv_events:
            raise ValueError(f"replica {self.address}: kv_snapshot needs kv_events")
        if self.kv_events and not self.kv_snapshot:
            host, _, port = self.kv_events.rpartition(":")
            if int(port) == 65535:
                raise ValueError(f"replica {self.address}: give kv_snapshot (kv_events' port + 1 is not a port)")
            object.__setattr__(self, "kv_snapshot", f"{host}:{int(port) + 1}")
        if not self.model:
            raise ValueError(f"replica {self.address}: model must not be empty")
        if not self.weight > 0:
            raise ValueError(f"replica {self.address}: weight must be > 0, got {self.weight}")


OPTIONAL = (
    "http",
    "kv_events",
    "kv_snapshot",
    "tokenizer",
    "kv_role",
)  # the keys of --replica besides address, model, weight


def parse_replica(value: str | Mapping[str, Any]) -> ReplicaSpec:
    """`HOST:PORT,model=NAME[,weight=W][,http=HOST:PORT][,kv_events=HOST:PORT][,kv_snapshot=HOST:PORT]
    [,tokenizer=DIR][,kv_role=prefill|decode|both]` (the command line) or a mapping of those keys (a config file)."""
    if isinstance(value, Mapping):
        fields = {str(k): v for k, v in value.items()}
    else:
        address, *pairs = str(value).split(",")
        fields = {"address": address}
        for pair in pairs:
            key, sep, v = pair.partition("=")
            if not sep:
                raise ValueError(f"replica {value!r}: expected key=value after the address, got {pair!r}")
            fields[key.strip()] = v.strip()
    unknown = set(fields) - {"address", "model", "weight", *OPTIONAL}
    if unknown:
        raise ValueError(f"replica {value!r}: unknown keys {sorted(unknown)}; expected address, model, weight, "
                         f"{', '.join(OPTIONAL)}")  # fmt: skip
    if "address" not in fields or "model" not in fields:
        raise ValueError(f"replica {value!r}: address and model are required")
    try:
        weight = float(fields.get("weight", 1.0))
    except (TypeError, ValueError):
        raise ValueError(f"replica {value!r}: weight must be a number, got {fields['weight']!r}") from None
    optional = {key: str(fields.get(key) or "").strip() for key in OPTIONAL}
    return ReplicaSpec(str(fields["address"]).strip(), str(fields["model"]).strip(), weight, **optional)


@dataclass(frozen=True, slots=True)
class Routing:
    """How requests are spread over the replicas."""

    routing_strategy: str = setting(
        "least_loaded",
        readers=ROUTER,
        help="round_robin, least_loaded, prefix, latency, kv (router_node/strategies.py), or "
        "module:function for your own (see router_node/routing.py and deploy/custom_route.py)",
    )
    routing_prefix_chars: int = setting(
        256,
        readers=ROUTER,
        help="prefix: characters of the prompt (a quarter as many token ids) whose hash picks the replica; keep "
        "it shorter than the prompts' shared part (the system prompt)",
    )
    routing_load_factor: float = setting(
        DEFAULT_LOAD_FACTOR,
        readers=ROUTER,
        help="prefix: a replica takes a request only while its open streams stay within this multiple of its "
        "weighted share of all open streams; else the ring's next replica does",
    )
    kv_overlap_weight: float = setting(
        DEFAULT_OVERLAP_WEIGHT,
        readers=ROUTER,
        help="kv: what a prompt block a replica would compute costs against a block of work it has (cost = weight x "
        "uncached blocks + prompt blocks it has yet to compute + blocks its requests hold); higher follows the "
        "cache harder, 0 ignores it",
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class RouterServer:
    """Where the router listens, and its control."""

    host: str = setting("127.0.0.1", readers=ROUTER, help="gRPC bind address")
    port: int = setting(50050, low=0, high=65535, readers=ROUTER, help="gRPC port")
    openai_port: int = setting(
        0,
        low=0,
        high=65535,
        readers=ROUTER,
        help="port of the OpenAI-compatible HTTP API on --host, forwarded to the replicas' own (http= in "
        "--replica; 0: off)",
    )
    control_token: str = setting(
        "",
        env=TOKEN_ENV,
        readers=ROUTER,
        help=f"the router's Control RPCs need metadata 'authorization: Bearer TOKEN' (default: ${TOKEN_ENV}; "
        "empty: open)",
    )
    shutdown_timeout: float = setting(
        30.0,
        low=0,
        aliases=("drain_timeout",),
        readers=ROUTER,
        help="on SIGTERM/SIGINT: seconds to let open streams finish while new ones are refused (0: no limit; a "
        "second signal stops at once); --drain-timeout is its former name",
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, slots=True)
class Replicas:
    """The replicas: who they are, how they are watched, moved between, split."""

    replica: tuple[ReplicaSpec, ...] = setting(
        (),
        parse=parse_replica,
        repeat="append",
        metavar="HOST:PORT,model=NAME[,weight=W][,http=HOST:PORT][,kv_events=HOST:PORT][,tokenizer=DIR]",
        readers=ROUTER,
        help="a scheduler to route to (its gRPC address), the model name it serves (its --served-model-name), its "
        "weight (default 1), its OpenAI API (its --openai-port, for the router's --openai-port), and for "
        "--routing-strategy kv its KV events (its --kv-events-port; kv_snapshot=HOST:PORT when not that port + 1) "
        "and the model's folder (to tokenize text like it); repeatable. In a config file: a list of {address, "
        "model, weight, http, kv_events, kv_snapshot, tokenizer}",
    )
    default_model: str = setting("", readers=ROUTER, help="the model of requests that name none (default: the first)")
    replica_api_key: str = setting(
        "",
        env=API_KEY_ENV,
        readers=ROUTER,
        help=f"the replicas' --api-key, sent with every HTTP request forwarded to them (default: ${API_KEY_ENV})",
    )
    replica_control_token: str = setting(
        "",
        env=TOKEN_ENV,
        readers=ROUTER,
        help=f"the replicas' --control-token, for GetStats (default: ${TOKEN_ENV})",
    )
    probe_interval: float = setting(
        0.5, above=0, readers=ROUTER, help="seconds between two health checks (and GetStats) of each replica"
    )
    probe_timeout: float = setting(
        1.0,
        above=0,
        readers=ROUTER,
        help="seconds a replica has to answer a health check, GetStats or Abort before it counts as down",
    )
    rebalance: bool = setting(
        False,
        readers=ROUTER,
        help="move a replica's longest-running gRPC stream to another replica (live migration) while its queue is "
        "long and another replica of its model is idle (needs the replicas' Control: --replica-control-token)",
    )
    disaggregate: bool = setting(
        False,
        readers=ROUTER,
        help="compute each gRPC request's prompt on a replica with kv_role=prefill (or both) and generate on one "
        "with kv_role=decode (or both), which pulls the prompt's KV from the first (vllm-serve --kv-role)",
    )
    disaggregate_min_prompt_tokens: int = setting(
        DEFAULT_MIN_PROMPT_TOKENS,
        low=0,
        metavar="N",
        readers=ROUTER,
        help="with --disaggregate, a prompt shorter than N tokens skips the prefill replica and is computed where it "
        "decodes (too few blocks to be worth moving; 0: every prompt is moved). Counted without a tokenizer: token "
        "ids exactly, text (a chat's message contents) as its characters / 4",
    )

    def __post_init__(self) -> None:
        check(self)
