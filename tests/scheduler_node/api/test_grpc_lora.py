"""LoRA on the gRPC Control service: load, list, use by `model`, unload, behind the control token; an unloaded
adapter's requests are NOT_FOUND while the base model's keep running; a router's prober learns the list."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from proto import serving_pb2 as pb
from proto.lora import BaseShapes
from router_node.metrics import RouterMetrics
from router_node.probe import Prober
from router_node.replica import SERVING, Replica, ReplicaPool, ReplicaSpec
from router_node.request import RouteRequest
from router_node.routing import Router
from router_node.upstream import Forwarder, UpstreamError, open_links
from scheduler_node.api.grpc_lora import adapter_info
from scheduler_node.engine.lora_registry import LoraRegistry
from tests.scheduler_node.api.test_grpc_server import MODEL, TOKEN_HEADER, Door, greedy, read_all, serve, status_of
from tests.support.lora import write_adapter
from tests.support.stand_in import stand_in_engine

pytestmark = pytest.mark.unit

BASE = BaseShapes(hidden=16, q_size=16, kv_size=8, intermediate=32, num_layers=2)


def test_load_list_use_and_unload_an_adapter_over_grpc(tmp_path: Path) -> None:
    adapter = str(write_adapter(tmp_path / "sql", BASE))
    engine = stand_in_engine()
    engine.loras = LoraRegistry(BASE, max_rank=8, base_name=MODEL)
    load = pb.LoadLoraAdapterRequest(lora_name="sql", lora_path=adapter)

    async def scenario(d: Door) -> None:
        code, _ = await status_of(d.control.LoadLoraAdapter(load))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        for bad, field in (
            (pb.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(tmp_path / "none")), "lora_path"),
            (pb.LoadLoraAdapterRequest(lora_name="", lora_path=adapter), "lora_name"),
            (pb.LoadLoraAdapterRequest(lora_name=MODEL, lora_path=adapter), "lora_name"),
        ):
            code, detail = await status_of(d.control.LoadLoraAdapter(bad, metadata=TOKEN_HEADER))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.startswith(field), detail
        code, _ = await status_of(d.stub.Generate(greedy([5, 6, 7], 2, model="sql")).read())
        assert code == grpc.StatusCode.NOT_FOUND

        info = await d.control.LoadLoraAdapter(load, metadata=TOKEN_HEADER)
        assert (info.name, info.parent, info.id) == ("sql", MODEL, 1)
        assert engine.loras is not None and info == adapter_info(engine.loras.refs()[0], MODEL)
        code, _ = await status_of(d.control.LoadLoraAdapter(load, metadata=TOKEN_HEADER))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        listed = await d.control.ListLoraAdapters(pb.ListLoraAdaptersRequest(), metadata=TOKEN_HEADER)
        assert [a.name for a in listed.adapters] == ["sql"]
        replica, prober = await _router_view(d.address)
        assert replica.adapters == {"sql"}, "a router learns the adapters a replica serves"
        assert (await read_all(d.stub.Generate(greedy([5, 6, 7], 2, model="sql"))))[-1].finish_reason == "length"
        stats = await d.control.GetStats(pb.GetStatsRequest(), metadata=TOKEN_HEADER)
        assert [(p.tier, p.adapters, p.capacity, p.bytes) for p in stats.lora_memory] == [
            ("device", 1, 1, 2 * (4 * 16 * 2 + 16 * 4 + 8 * 4) * 4)  # 2 layers of q and v, float32
        ]

        gone = await d.control.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="sql"), metadata=TOKEN_HEADER)
        assert gone.id == info.id
        code, _ = await status_of(d.stub.Generate(greedy([5, 6, 7], 2, model="sql")).read())
        assert code == grpc.StatusCode.NOT_FOUND
        code, _ = await status_of(
            d.control.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="sql"), metadata=TOKEN_HEADER)
        )
        assert code == grpc.StatusCode.NOT_FOUND
        assert (await read_all(d.stub.Generate(greedy([5, 6, 7], 2, model=MODEL))))[-1].finish_reason == "length"
        with pytest.raises(UpstreamError) as err:  # the router's list is stale: it still names "sql"
            await _first_of(Forwarder(Router(prober.pool, "round_robin"), prober.links, RouterMetrics()))
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert replica.adapters == frozenset(), "a router forgets an adapter its replica answers NOT_FOUND for"
        await prober.learn_adapters(replica)
        assert replica.adapters == frozenset()
        for link in prober.links.values():
            await link.channel.close()

    serve(engine, scenario, control_token="s3cret")


async def _first_of(forwarder: Forwarder) -> pb.GenerateResponse:
    """The first answer to a request for "sql" sent through a router over one replica (whose list is stale)."""
    async for response in forwarder.generate(greedy([5, 6, 7], 2, model="sql"), RouteRequest("sql"), 10.0):
        return response
    raise AssertionError("no answer")


async def _router_view(address: str) -> tuple[Replica, Prober]:
    """A router's prober of the replica at `address`, after it asked which adapters it serves."""
    pool = ReplicaPool([ReplicaSpec(address, MODEL)])
    prober = Prober(pool, open_links(pool), RouterMetrics(), interval=1.0, timeout=5.0, control_token="s3cret")
    pool.set_state(pool.replicas[0], SERVING)
    await prober.learn_adapters(pool.replicas[0])
    return pool.replicas[0], prober


def test_lora_control_without_lora_is_a_failed_precondition() -> None:
    async def scenario(d: Door) -> None:
        load = pb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/x")
        code, detail = await status_of(d.control.LoadLoraAdapter(load))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in detail
        assert not (await d.control.ListLoraAdapters(pb.ListLoraAdaptersRequest())).adapters

    serve(stand_in_engine(), scenario)
