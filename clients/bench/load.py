"""Open-loop load: requests leave at their arrival times whether or not earlier ones finished (optionally capped
at --max-concurrency in flight), until every prompt was sent or --duration passed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tqdm import tqdm

from clients.bench.backends import Backend, RequestResult, SendOptions
from clients.bench.workload import BenchRequest, arrival_times


@dataclass(frozen=True, slots=True)
class LoadOptions:
    burstiness: float = 1.0
    max_concurrency: int = 0  # 0: no cap
    duration: float = 0.0  # seconds after which no new request is sent (0: send them all)
    seed: int = 0
    progress: bool = True


async def run_load(
    backend: Backend, requests: list[BenchRequest], rate: float, send: SendOptions, load: LoadOptions
) -> tuple[list[RequestResult], float]:
    """Every result (in send order) and the seconds from the first send to the last answer."""
    times = arrival_times(len(requests), rate, load.burstiness, load.seed)
    if load.duration:
        times = [t for t in times if t < load.duration]
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(times), desc=f"rate {rate:g}/s", unit="req", disable=not load.progress, leave=False)

    async def one(request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await backend.send(request, send)
        else:
            async with limit:
                result = await backend.send(request, send)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for request, at in zip(requests, times):
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.ensure_future(one(request)))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    bar.close()
    return list(results), elapsed
