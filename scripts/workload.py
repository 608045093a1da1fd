"""Workloads the benchmarks send over gRPC."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.wire import SamplingOptions
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore


def send_all(work: list[tuple[list[int], int]], one: Callable[[list[int], int], int]) -> tuple[list[int], float]:
    """Every (prompt ids, max_tokens) request at once, each on its own thread through `one`, which returns the
    tokens it got; the counts and the wall time."""
    counts = [0] * len(work)

    def run(i: int) -> None:
        counts[i] = one(*work[i])

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts, time.perf_counter() - start


def stream_workload(channel: grpc.Channel, work: list[tuple[list[int], int]]) -> tuple[list[int], float]:
    """Send every (prompt ids, max_tokens) request at once, greedy with ignore_eos; return the tokens each
    got and the wall time (benchmarks)."""
    stub = pb_grpc.GenerationStub(channel)

    def one(prompt: list[int], max_tokens: int) -> int:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
        return sum(len(r.token_ids) for r in stub.Generate(req, timeout=3600))

    return send_all(work, one)


def greedy_spec(request_id: str, prompt: list[int], max_tokens: int) -> RequestSpec:
    """A greedy request that ignores eos (its length is fixed in advance)."""
    return RequestSpec(request_id, prompt, SamplingOptions(temperature=0.0), max_tokens, [], True, 1, 50)


async def run_to_idle(engine: EngineCore, specs: list[RequestSpec]) -> None:
    """Submit every request to the engine core at once and run it until all of them finished."""
    loop = engine.run()
    task = asyncio.ensure_future(loop)
    for spec in specs:
        engine.submit(spec)
    idle = asyncio.ensure_future(engine.wait_idle())
    await asyncio.wait({task, idle}, return_when=asyncio.FIRST_COMPLETED)
    task.cancel()
    if not idle.done():
        idle.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RuntimeError("the engine loop stopped before every request finished")
