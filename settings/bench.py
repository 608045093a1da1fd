"""vllm-bench's settings: the server it measures, the workload it sends, how it sends it, what it writes."""

from __future__ import annotations

from dataclasses import dataclass

from settings.server import DEFAULT_MODEL
from settings.setting import setting

ENDPOINTS = ("completions", "chat")
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal")
BENCH = "bench"


@dataclass(frozen=True, slots=True)
class BenchTarget:
    """The server measured."""

    backend: str = setting("openai", choices=("openai", "grpc"), readers=BENCH, help="the protocol to measure")
    base_url: str = setting("http://127.0.0.1:8000/v1", readers=BENCH, help="openai: the API's base URL")
    grpc_address: str = setting("127.0.0.1:50051", readers=BENCH, help="grpc: minivllm's HOST:PORT")
    endpoint: str = setting("completions", choices=ENDPOINTS, readers=BENCH, help="completions, or chat (template)")
    model: str = setting("", readers=BENCH, help="openai: the model name to request (default: the server's first)")
    api_key: str = setting(
        "", env="OPENAI_API_KEY", readers=BENCH, help="openai: bearer key (default: $OPENAI_API_KEY)"
    )
    send_text: bool = setting(
        False,
        readers=BENCH,
        help="openai: send prompts as text even where token ids are known (for servers that take no token-id prompts)",
    )


@dataclass(frozen=True, slots=True)
class BenchWorkload:
    """The requests sent."""

    dataset: str = setting(
        "random",
        choices=("random", "prefix", "jsonl"),
        readers=BENCH,
        help="random token prompts; prefix: shared prefixes + random suffixes; jsonl: --dataset-path",
    )
    dataset_path: str | None = setting(
        None,
        readers=BENCH,
        help='jsonl: lines of {"prompt": ...} or {"messages": [...]}, each with an optional "max_tokens"',
    )
    tokenizer: str = setting(
        DEFAULT_MODEL,
        readers=BENCH,
        help="model folder whose vocabulary random prompts are drawn from "
        "(use the served model's; default: SmolLM2-135M)",
    )
    num_prompts: int = setting(100, readers=BENCH, help="requests per request rate")
    input_len: int = setting(128, readers=BENCH, help="random/prefix: mean prompt tokens (prefix: suffix)")
    output_len: int = setting(64, readers=BENCH, help="mean output tokens (jsonl: where a line sets none)")
    length_dist: str = setting("uniform", choices=LENGTH_DISTRIBUTIONS, readers=BENCH, help="how lengths vary")
    range_ratio: float = setting(0.0, readers=BENCH, help="uniform: lengths in mean x [1-r, 1+r]; lognormal: sigma")
    prefix_len: int = setting(256, readers=BENCH, help="prefix: tokens of each shared prefix")
    num_prefixes: int = setting(4, readers=BENCH, help="prefix: distinct prefixes, used round robin")
    temperature: float = setting(0.0, readers=BENCH, help="sampling temperature (0: greedy)")
    ignore_eos: bool = setting(
        True,
        readers=BENCH,
        help="run outputs to their set length (vLLM's extension; --no-ignore-eos: strict servers)",
    )


@dataclass(frozen=True, slots=True)
class BenchLoad:
    """How the requests are sent."""

    request_rate: str = setting("inf", readers=BENCH, help="requests/s, or a sweep: 1,2,4,inf (inf: all at once)")
    burstiness: float = setting(1.0, readers=BENCH, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    max_concurrency: int = setting(0, readers=BENCH, help="requests in flight at most (0: no cap)")
    duration: float = setting(
        0.0,
        readers=BENCH,
        help="seconds per rate after which no new request is sent (0: send all --num-prompts)",
    )
    request_timeout: float = setting(600.0, readers=BENCH, help="seconds one request may take")
    goodput: tuple[str, ...] = setting(
        (),
        repeat="extend",
        metavar="KEY:MS",
        readers=BENCH,
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (milliseconds; repeatable)",
    )
    seed: int = setting(
        0, readers=BENCH, help="seeds the prompts, lengths and arrival times (rate i of a sweep: seed + i)"
    )


@dataclass(frozen=True, slots=True)
class BenchOutput:
    """What vllm-bench writes."""

    json: str | None = setting(
        None, metavar="FILE", readers=BENCH, help="write settings, summaries and per-request timings"
    )
    plot: str | None = setting(
        None, metavar="DIR", readers=BENCH, help="write latency_vs_rate.png and itl_cdf.png here"
    )
    progress: bool = setting(True, readers=BENCH, help="tqdm progress bars")
