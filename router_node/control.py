"""The router's Control service: ListReplicas (each scheduler's address, model, state and load), GetStats summed
over the replicas (of one model, or all), and Drain (stop admitting, wait for the open streams). ListWorkers and
ResizeCache belong to one scheduler: ask the replica, whose address ListReplicas gives."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from router_node.grpc_door import RouterGeneration
from router_node.replica import DOWN
from scheduler_node.api.grpc_server import drain_timeout

SUMMED = (
    "total_blocks", "used_blocks", "free_blocks", "num_running", "num_waiting", "num_preemptions",
    "cached_free_blocks", "prefix_cache_queries", "prefix_cache_hits", "preemptions_recompute", "preemptions_swap",
    "swap_blocks_used", "swap_blocks_total", "usable_blocks", "interrupted_steps", "migrations_imported",
    "migrations_recomputed", "migration_kv_tokens_imported",
)  # fmt: skip


def aggregate(replies: Sequence[pb.Stats]) -> pb.Stats:
    """The replicas' stats as one server's: counts summed, ratios recomputed from the sums, fragmentation weighted
    by blocks in use; block_size and max_model_len the largest among them."""
    total = pb.Stats(**{name: sum(getattr(s, name) for s in replies) for name in SUMMED})
    total.kv_usage = total.used_blocks / total.usable_blocks if total.usable_blocks else 0.0
    queries = total.prefix_cache_queries
    total.prefix_cache_hit_rate = total.prefix_cache_hits / queries if queries else 0.0
    used = total.used_blocks
    total.fragmentation = sum(s.fragmentation * s.used_blocks for s in replies) / used if used else 0.0
    total.mean_worker_idle_ms = sum(s.mean_worker_idle_ms for s in replies) / len(replies) if replies else 0.0
    total.block_size = max((s.block_size for s in replies), default=0)
    total.max_model_len = max((s.max_model_len for s in replies), default=0)
    return total


class RouterControl(pb_grpc.ControlServicer):
    def __init__(self, generation: RouterGeneration, replica_token: str = "") -> None:
        self.generation = generation
        self.pool = generation.pool
        self.links = generation.forwarder.links
        self.metadata = [("authorization", f"Bearer {replica_token}")] if replica_token else []

    async def GetStats(  # noqa: N802
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.Stats:
        if request.model and request.model not in self.pool.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model: {request.model!r} is not served here")
        replicas = [r for r in self.pool.replicas if r.state != DOWN and request.model in ("", r.model)]
        timeout = self.generation.call_timeout
        answers = await asyncio.gather(
            *(
                self.links[r.address].control.GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=self.metadata)
                for r in replicas
            ),
            return_exceptions=True,
        )
        return aggregate([a for a in answers if isinstance(a, pb.Stats)])

    async def ListReplicas(  # noqa: N802
        self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListReplicasResponse:
        return pb.ListReplicasResponse(
            replicas=[
                pb.ReplicaStatus(
                    address=r.address,
                    model=r.model,
                    state=r.state,
                    weight=r.weight,
                    num_running=r.load.num_running,
                    num_waiting=r.load.num_waiting,
                    kv_usage=r.load.kv_usage,
                    in_flight=r.in_flight,
                    requests=r.requests,
                    ttft_ewma_s=r.ttft_ewma or 0.0,
                    tpot_ewma_s=r.tpot_ewma or 0.0,
                )
                for r in self.pool.replicas
            ]
        )

    async def Drain(  # noqa: N802
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        remaining = await self.generation.drain(await drain_timeout(request, context))
        return pb.DrainResponse(drained=remaining == 0, remaining=remaining)

    async def ListWorkers(  # noqa: N802
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _PER_REPLICA)
        raise AssertionError("abort raises")

    async def ResizeCache(  # noqa: N802
        self, request: pb.ResizeCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResizeCacheResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _PER_REPLICA)
        raise AssertionError("abort raises")


_PER_REPLICA = "vllm-router fronts several schedulers: ask a replica (Control.ListReplicas gives their addresses)"
