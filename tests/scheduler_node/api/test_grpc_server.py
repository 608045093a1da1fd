"""The gRPC door in this process: a grpc.aio server on a loopback port drives an EngineCore over stand-in workers,
and a grpc.aio channel calls it as a client would. Every status the door maps (NOT_FOUND, UNAVAILABLE,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS, an engine error's own code), cancels, Abort, and the Control
RPCs with and without a token, without a child process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from minivllm.cluster import free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.wire import Assignment, WorkerHello, WorkerReady
from scheduler_node.api.grpc_decode import DecodeGuard
from scheduler_node.api.grpc_server import GenerationService, build_server
from scheduler_node.api.health import LIVENESS, report_health, set_serving
from scheduler_node.api.security import ControlAuth, server_credentials
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.rank_registry import RankRegistry
from tests.support.stand_in import TOKEN, ControlledWorkers, running, stand_in_engine, tokenizer
from tests.support.waiting import until

pytestmark = pytest.mark.unit

MODEL = "tiny"
TOKEN_HEADER = (("authorization", "Bearer s3cret"),)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Door:
    address: str
    service: GenerationService
    stub: pb_grpc.GenerationStub
    control: pb_grpc.ControlStub
    health_service: health.aio.HealthServicer
    health: health_pb2_grpc.HealthStub


@asynccontextmanager
async def door(engine: EngineCore | None, control_token: str = "") -> AsyncIterator[Door]:
    """The gRPC server over `engine` (None: the workers have not joined) and a client channel to it."""
    service = GenerationService(tokenizer(), MODEL)
    service.engine = engine
    address = f"127.0.0.1:{free_port()}"
    server, health_service = build_server(service, address, control_token=control_token)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stubs = pb_grpc.GenerationStub(channel), pb_grpc.ControlStub(channel)
            yield Door(address, service, *stubs, health_service, health_pb2_grpc.HealthStub(channel))
    finally:
        await server.stop(None)


def serve(engine: EngineCore | None, scenario: Callable[[Door], Awaitable[None]], control_token: str = "") -> None:
    """Run `scenario` against the door, the engine's loop running meanwhile."""

    async def main() -> None:
        async with door(engine, control_token) as d:
            if engine is None:
                await scenario(d)
                return
            async with running(engine):
                await scenario(d)

    asyncio.run(main())


def greedy(ids: list[int], max_tokens: int, request_id: str = "", **kw: Any) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling, **kw)


PROMPT = list(range(100, 120))


async def status_of(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def read_all(call: Any) -> list[pb.GenerateResponse]:
    return [r async for r in call]


def test_generate_streams_the_engines_tokens_and_usage() -> None:
    async def scenario(d: Door) -> None:
        responses = await read_all(d.stub.Generate(greedy(PROMPT, 5, request_id="mine", model=MODEL)))
        assert [t for r in responses for t in r.token_ids] == [TOKEN] * 5
        assert {r.request_id for r in responses} == {"mine"}
        last = responses[-1]
        assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == ("length", 20, 5)
        assert last.usage.cached_tokens == 0
        anonymous = await read_all(d.stub.Generate(greedy(PROMPT, 2)))
        assert len(anonymous[0].request_id) == 32, "a request without an id gets one"
        assert anonymous[-1].usage.cached_tokens == 16, "the prompt's one full block was cached"
        text = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=3, temperature=0.0))
        assert (await read_all(d.stub.Generate(text)))[-1].finish_reason in ("length", "stop")

    serve(stand_in_engine(), scenario)


def test_the_door_refuses_with_the_status_that_names_the_problem() -> None:
    async def scenario(d: Door) -> None:
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 2, model="gpt-5"))))
        assert code == grpc.StatusCode.NOT_FOUND and "'gpt-5' is not served here" in details
        bad = greedy(PROMPT, 2)
        bad.sampling.temperature = -1
        code, details = await status_of(read_all(d.stub.Generate(bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("sampling.temperature"), details
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 2, deadline_s=-1))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("deadline_s:")
        code, details = await status_of(d.stub.Abort(pb.AbortRequest()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id:")

    serve(stand_in_engine(), scenario)


def test_without_an_engine_generation_is_unavailable_and_control_too() -> None:
    async def scenario(d: Door) -> None:
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 2))))
        assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "workers are joining")
        code, _ = await status_of(d.control.GetStats(pb.GetStatsRequest()))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert not (await d.stub.Abort(pb.AbortRequest(request_id="x"))).found
        assert list((await d.control.ListWorkers(pb.ListWorkersRequest())).workers) == []

    serve(None, scenario)


def test_a_full_queue_and_a_running_id_are_refused_at_once() -> None:
    workers = ControlledWorkers(hold=True)  # nothing finishes: requests stay live and waiting
    engine = stand_in_engine(EngineOptions(max_waiting_requests=2), workers=workers, max_num_seqs=1)

    async def scenario(d: Door) -> None:
        first = d.stub.Generate(greedy(PROMPT, 50, request_id="one"))
        await until(lambda: engine.is_live("one") and not engine.scheduler.waiting, 10, "the first one runs")
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 2, request_id="one"))))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "'one' is already running" in details
        waiting = [d.stub.Generate(greedy(PROMPT, 2, request_id=f"w{i}")) for i in range(2)]
        await until(lambda: len(engine.scheduler.waiting) == 2, 10, "two waiting")
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 2))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-waiting-requests 2" in details
        workers.release()
        for call in (first, *waiting):
            assert (await read_all(call))[-1].finish_reason == "length"

    serve(engine, scenario)


def test_an_engine_error_ends_the_stream_with_its_code() -> None:
    engine = stand_in_engine(workers=ControlledWorkers(hold=True))  # the step never ends: the deadline does

    async def scenario(d: Door) -> None:
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 50, deadline_s=0.05))))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and details.startswith("deadline_s:")

    serve(engine, scenario)


def test_a_client_that_goes_away_or_aborts_ends_its_request() -> None:
    workers = ControlledWorkers(hold=True)
    engine = stand_in_engine(workers=workers)

    async def scenario(d: Door) -> None:
        call = d.stub.Generate(greedy(PROMPT, 50, request_id="gone"))
        await until(lambda: engine.is_live("gone"), 10, "the request is live")
        call.cancel()
        await until(lambda: not engine.is_live("gone"), 10, "a cancelled call aborts its request")
        kept = d.stub.Generate(greedy(PROMPT, 50, request_id="aborted"))
        await until(lambda: engine.is_live("aborted"), 10, "the request is live")
        assert (await d.stub.Abort(pb.AbortRequest(request_id="aborted"))).found
        assert (await read_all(kept))[-1].finish_reason == "abort"
        assert not (await d.stub.Abort(pb.AbortRequest(request_id="aborted"))).found
        assert engine.scheduler.blocks.num_free == 64

    serve(engine, scenario)


def test_control_reports_resizes_and_drains() -> None:
    engine = stand_in_engine()

    async def scenario(d: Door) -> None:
        await read_all(d.stub.Generate(greedy(PROMPT, 3)))
        stats = await d.control.GetStats(pb.GetStatsRequest())
        assert (stats.total_blocks, stats.num_running, stats.num_waiting) == (64, 0, 0)
        assert [p.tier for p in stats.memory] == ["device", "swap"]  # the stand-in holds no swap: an empty pool
        resized = await d.control.ResizeCache(pb.ResizeCacheRequest(num_blocks=32))
        assert resized.usable_blocks == 32 == engine.scheduler.blocks.usable_blocks
        code, details = await status_of(d.control.ResizeCache(pb.ResizeCacheRequest(num_blocks=65)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "num_blocks: must be in [1, 64]"
        exits: list[str] = []
        d.service.on_drained = lambda: exits.append("drained")  # --exit-after-drain
        code, details = await status_of(d.control.Drain(pb.DrainRequest(timeout_s=-1)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("timeout_s:") and not exits
        code, details = await status_of(d.control.Migrate(pb.MigrateRequest()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_ids:")
        assert (await d.control.Migrate(pb.MigrateRequest(request_ids=["gone"]))).migrated == 0  # and serves on
        drained = await d.control.Drain(pb.DrainRequest(timeout_s=5))
        assert (drained.drained, drained.remaining) == (True, 0) and exits == ["drained"]
        code, details = await status_of(read_all(d.stub.Generate(greedy(PROMPT, 2))))
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details

    serve(engine, scenario)


def test_list_workers_reports_every_rank_from_the_registry() -> None:
    registry = RankRegistry(lambda identity, message: "", heartbeat_timeout=10.0)
    registry.assemble(lambda rank: Assignment(rank, 2, "/m", "auto", 16, 64, 8), 60.0)
    registry.hello(b"a", WorkerHello("host-a", 11, "cpu"), "")
    registry.ready(b"a", WorkerReady(0, 40, 40_000))
    registry.hello(b"b", WorkerHello("host-b", 12, "cpu"), "")  # still loading

    async def scenario(d: Door) -> None:
        d.service.link = cast(Any, registry)  # what WorkerLink.status() reads
        workers = (await d.control.ListWorkers(pb.ListWorkersRequest())).workers
        assert [(w.rank, w.host, w.pid, w.state, w.num_kv_blocks) for w in workers] == [
            (0, "host-a", 11, "ready", 40), (1, "host-b", 12, "joining", 0)]  # fmt: skip
        assert all(0 <= w.heartbeat_age_s < 60 for w in workers)

    serve(stand_in_engine(), scenario)


def test_control_needs_the_token_when_one_is_set_and_generation_does_not() -> None:
    async def scenario(d: Door) -> None:
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            code, _ = await status_of(d.control.GetStats(pb.GetStatsRequest(), metadata=metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        stats = await d.control.GetStats(pb.GetStatsRequest(), metadata=TOKEN_HEADER)
        assert stats.total_blocks == 64
        assert (await read_all(d.stub.Generate(greedy(PROMPT, 2))))[-1].finish_reason == "length"

    serve(stand_in_engine(), scenario, control_token="s3cret")
    with pytest.raises(ValueError, match="must not be empty"):
        ControlAuth("")
    with pytest.raises(ValueError, match="go together"):
        server_credentials("cert.pem", "")


def test_every_control_rpc_needs_the_token() -> None:
    """Each method of the Control service, those added later included, not just GetStats: none answers without it."""
    methods = pb.DESCRIPTOR.services_by_name["Control"].methods

    async def scenario(d: Door) -> None:
        for method in methods:
            call = getattr(d.control, method.name)(getattr(pb, method.input_type.name)())
            code, _ = await status_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED, method.name

    assert {m.name for m in methods} >= {"GetStats", "Drain", "LoadLoraAdapter"}
    serve(stand_in_engine(), scenario, control_token="s3cret")


def test_health_is_serving_exactly_while_the_engine_takes_requests() -> None:
    workers = ControlledWorkers()
    engine = stand_in_engine(EngineOptions(rejoin_timeout=60), workers=workers)

    async def status(d: Door, service: str = "") -> int:
        return int((await d.health.Check(health_pb2.HealthCheckRequest(service=service))).status)

    async def scenario(d: Door) -> None:
        await set_serving(d.health_service, False)  # as the scheduler starts, before the workers join
        assert (await status(d), await status(d, LIVENESS)) == (NOT_SERVING, SERVING)
        reporter = asyncio.ensure_future(report_health(engine, d.health_service))
        try:
            await until_status(d, status, SERVING)
            workers.lose()
            await until_status(d, status, NOT_SERVING)
            workers.rejoin()
            await until_status(d, status, SERVING)
            await engine.drain(0.0)
            await until_status(d, status, NOT_SERVING)
            assert await status(d, LIVENESS) == SERVING, "a draining scheduler is alive"
        finally:
            reporter.cancel()

    serve(engine, scenario)


async def until_status(d: Door, status: Callable[[Door], Awaitable[int]], wanted: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while await status(d) != wanted:
        assert asyncio.get_running_loop().time() < deadline, f"health never became {wanted}"
        await asyncio.sleep(0.001)


NOT_UTF8 = b"\x0a\x02\xed\xa0"  # request_id (field 1 of both requests) holding bytes that are no UTF-8 text


def test_a_request_that_does_not_parse_is_invalid_argument() -> None:
    """Through the door's own server, and through a server whose only interceptor is the DecodeGuard."""

    async def call(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            raw = {"request_serializer": None, "response_deserializer": None}
            generate = channel.unary_stream("/minivllm.v1.Generation/Generate", **raw)  # type: ignore[arg-type]
            code, details = await status_of(read_all(generate(NOT_UTF8)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in details, details
            abort = channel.unary_unary("/minivllm.v1.Generation/Abort", **raw)  # type: ignore[arg-type]
            code, details = await status_of(abort(NOT_UTF8))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "must be UTF-8" in details, details

    async def scenario(d: Door) -> None:
        address = f"127.0.0.1:{free_port()}"
        bare = grpc.aio.server(interceptors=[DecodeGuard()])
        pb_grpc.add_GenerationServicer_to_server(d.service, bare)
        bare.add_insecure_port(address)
        await bare.start()
        try:
            await call(address)
        finally:
            await bare.stop(None)
        await call(d.address)

    serve(stand_in_engine(), scenario)
