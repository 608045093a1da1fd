"""vllm-bench: a serving benchmark. Open-loop arrivals at one or several request rates against minivllm's gRPC door
or any OpenAI-compatible server; prints throughput, TTFT, TPOT, ITL and end-to-end latency (mean, P50, P90,
P99) and goodput under SLOs, and writes JSON and PNG plots.

    vllm-bench --base-url http://127.0.0.1:8000/v1 --request-rate 1,2,4,inf --num-prompts 200 --plot out/
    vllm-bench --backend grpc --grpc-address 127.0.0.1:50051 --dataset prefix --goodput ttft:500 tpot:50
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

from clients.bench.backends import Backend, GrpcBackend, OpenAIBackend, RequestResult, SendOptions
from clients.bench.load import LoadOptions, run_load
from clients.bench.report import plot, table, write_json
from clients.bench.results import RunSummary, parse_slos, summarize
from clients.bench.workload import BenchRequest, Lengths, jsonl_requests, prefix_requests, random_requests
from scheduler_node.engine.model_path import resolve_model
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.commands import command_parser
from settings.config_file import parse_args

logger = logging.getLogger("vllm-bench")


def build_parser() -> argparse.ArgumentParser:
    return command_parser("vllm-bench", __doc__ or "", formatter_class=argparse.RawTextHelpFormatter)


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--request-rate {text}: expected numbers or inf, comma-separated") from None
    if not rates or not all(r > 0 for r in rates):
        raise ValueError(f"--request-rate {text}: rates must be > 0")
    return rates


def prompt_maker(args: argparse.Namespace) -> Callable[[int], list[BenchRequest]]:
    """The dataset as a function of a seed (each rate of a sweep gets its own prompts, so one rate's prefix-cache
    hits do not flatter the next); ValueError naming a flag out of range."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    n, outputs = args.num_prompts, Lengths(args.output_len, args.length_dist, args.range_ratio)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        path = Path(args.dataset_path)
        jsonl_requests(path, n, outputs, 0)  # read it now: a bad file fails before any request
        return lambda seed: jsonl_requests(path, n, outputs, seed)
    tokenizer = ModelTokenizer(resolve_model(args.tokenizer))
    inputs = Lengths(args.input_len, args.length_dist, args.range_ratio)
    if args.dataset == "prefix":
        prefix_requests(tokenizer, 1, args.prefix_len, args.num_prefixes, inputs, outputs, 0)  # checks the flags
        return lambda seed: prefix_requests(tokenizer, n, args.prefix_len, args.num_prefixes, inputs, outputs, seed)
    return lambda seed: random_requests(tokenizer, n, inputs, outputs, seed)


def make_backend(args: argparse.Namespace) -> Backend:
    if args.backend == "grpc":
        return GrpcBackend(args.grpc_address)
    return OpenAIBackend(args.base_url, args.model, args.api_key, args.send_text)


async def sweep(
    args: argparse.Namespace, prompts: Callable[[int], list[BenchRequest]], rates: list[float]
) -> tuple[list[RunSummary], list[list[RequestResult]]]:
    """One load run per rate (rate i: prompts and arrivals from --seed + i)."""
    backend = make_backend(args)
    slos = parse_slos(args.goodput)
    send = SendOptions(args.endpoint, args.temperature, args.ignore_eos, args.request_timeout)
    await backend.open()
    try:
        summaries, results = [], []
        for i, rate in enumerate(rates):
            seed = args.seed + i
            load = LoadOptions(args.burstiness, args.max_concurrency, args.duration, seed, args.progress)
            rs, elapsed = await run_load(backend, prompts(seed), rate, send, load)
            summaries.append(summarize(rate, rs, elapsed, slos))
            results.append(rs)
            logger.info("rate %s: %d done in %.2f s", rate, summaries[-1].completed, elapsed)
    finally:
        await backend.close()
    return summaries, results


def describe(args: argparse.Namespace) -> str:
    target = args.grpc_address if args.backend == "grpc" else args.base_url
    return f"{args.backend} {target}, {args.dataset} dataset, {args.num_prompts} prompts per rate"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        rates = parse_rates(args.request_rate)
        parse_slos(args.goodput)
        summaries, results = asyncio.run(sweep(args, prompt_maker(args), rates))
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    print(f"{describe(args)}\n")
    print(table(summaries))
    for s in summaries:
        for error in s.errors:
            print(f"rate {s.request_rate:g}: failed: {error}", file=sys.stderr)
    config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    config["api_key"] = bool(args.api_key)  # never the key itself
    if args.json:
        write_json(Path(args.json), config, summaries, results)
    if args.plot:
        for path in plot(Path(args.plot), summaries, results, describe(args)):
            print(f"wrote {path}")
    return 0 if all(s.failed == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
