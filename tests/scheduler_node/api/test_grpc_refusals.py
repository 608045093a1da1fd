"""The gRPC door in-process, before an idle engine (issue 25, defects 2, 5, 6): a refused request is freed the
moment it is refused (no traceback keeps it in a reference cycle for a later full collection: the scheduler's
collector runs those only when idle after work), large refusals are followed by a trim of the heap, and what is
not a valid request is INVALID_ARGUMENT naming the field (or RESOURCE_EXHAUSTED past the message size), never
UNKNOWN."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from minivllm.cluster import free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.api import heap
from scheduler_node.api.grpc_server import GenerationService, build_server
from scheduler_node.api.request_bounds import MAX_REQUEST_BYTES
from scheduler_node.engine.core import EngineOptions
from settings.priority import PriorityConfig

pytestmark = pytest.mark.unit

MAX_MODEL_LEN = 1024
TOKENIZER: Any = SimpleNamespace(vocab_size=49152, max_token_chars=16)  # none of these requests is tokenized
GENERATE = "/" + pb.DESCRIPTOR.services_by_name["Generation"].full_name + "/Generate"


class IdleEngine:
    max_model_len = MAX_MODEL_LEN
    compact_tokens = 0
    options = EngineOptions(priorities=PriorityConfig(priority_ranges="realtime=80-100"))  # what the door reads

    def unavailable(self) -> str:
        return ""

    def queue_full(self, n: int) -> bool:
        return False

    def is_live(self, request_id: str) -> bool:
        return False


def live_requests() -> int:
    return sum(type(o) is pb.GenerateRequest for o in gc.get_objects())


async def serving(test: Callable[[grpc.aio.Channel, GenerationService], Any]) -> None:
    service = GenerationService(TOKENIZER, "tiny")
    service.engine = IdleEngine()  # type: ignore[assignment]
    address = f"127.0.0.1:{free_port()}"
    server, _ = build_server(service, address)
    await server.start()
    try:
        options = [("grpc.max_send_message_length", 2 * MAX_REQUEST_BYTES)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            await test(channel, service)
    finally:
        await server.stop(None)


async def refused(call: AsyncIterator[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value.code(), err.value.details() or ""


def large_requests() -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(prompt="a" * (MAX_REQUEST_BYTES - 4096)),  # past max_model_len x the longest token
        pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[40000] * 2_000_000)),  # ~6 MB, 2 M ids
    ]


async def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_a_refused_request_is_freed_when_refused_and_the_heap_trimmed() -> None:
    async def test(channel: grpc.aio.Channel, service: GenerationService) -> None:
        stub = pb_grpc.GenerationStub(channel)
        sent = (
            large_requests() + large_requests()
        )  # the client's own, alive to the end (its calls may hold them in cycles)
        for request in sent:
            code, details = await refused(stub.Generate(request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert details.startswith(("prompt:", "prompt_token_ids:")), details
        sent.append(pb.GenerateRequest(prompt="a" * (MAX_REQUEST_BYTES + 1)))
        assert (await refused(stub.Generate(sent[-1])))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        # No collection runs meanwhile (disabled): only reference counts free what the server received.
        await until(lambda: live_requests() == len(sent), 10, f"{live_requests() - len(sent)} refused requests alive")
        if heap.malloc_trim():
            await until(lambda: service.heap.trims >= 1, 10, "the heap was trimmed after the large refusals")

    gc.collect()
    gc.disable()
    try:
        asyncio.run(serving(test))
    finally:
        gc.enable()


def test_what_is_not_a_valid_request_is_invalid_argument_naming_the_field() -> None:
    ids = pb.TokenIds(ids=list(range(3, 3 + 1000)))
    deep = '{"a":' * 2000 + "[]" + "}" * 2000
    many = pb.SamplingParams(n=13, prompt_logprobs=20, max_tokens=1)  # 1000 x 21 x 13 entries
    cases = [
        (
            pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(json=deep)),
            (),
            "sampling.structured.json",
        ),
        (pb.GenerateRequest(prompt_token_ids=ids), (("x-priority", str(10**30)),), "priority"),
        (pb.GenerateRequest(prompt_token_ids=ids), (("x-priority", "urgent"),), "priority"),  # no such range
        (pb.GenerateRequest(prompt_token_ids=ids, sampling=many), (), "sampling.prompt_logprobs"),
    ]

    async def test(channel: grpc.aio.Channel, service: GenerationService) -> None:
        stub = pb_grpc.GenerationStub(channel)
        for request, metadata, field in cases:
            code, details = await refused(stub.Generate(request, metadata=metadata))
            assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, field), details
            assert "urgent" not in str(metadata) or "realtime=80-100" in details, details  # the door's own ranges
        # A string field that is not UTF-8 (what a lone surrogate becomes): the message does not parse.
        not_utf8 = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xed\xa0")
        raw = channel.unary_stream(GENERATE)
        code, details = await refused(raw(not_utf8))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details, details

    asyncio.run(serving(test))
