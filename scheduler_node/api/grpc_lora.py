"""The Control service's LoRA RPCs, the gRPC twins of `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(scheduler_node/api/openai_lora.py), behind the control token like every Control RPC (api/security.py)."""

from __future__ import annotations

import asyncio

import grpc

from proto import serving_pb2 as pb
from proto.lora import AdapterError
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.lora_registry import AdapterExists, LoraRegistry, UnknownAdapter


def adapter_info(ref: LoraRef, parent: str) -> pb.LoraAdapterInfo:
    return pb.LoraAdapterInfo(name=ref.name, path=ref.path, id=ref.id, parent=parent)


class LoraControl:
    """Mixed into ControlService: `engine_now()` is the engine (None while the workers join), `parent` the base
    model's served name."""

    def engine_now(self) -> EngineCore | None:
        raise NotImplementedError

    @property
    def parent(self) -> str:
        raise NotImplementedError

    async def _registry(self, context: grpc.aio.ServicerContext) -> LoraRegistry:
        engine = self.engine_now()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "workers are joining")
        elif engine.loras is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is off: start with --enable-lora")
        assert engine is not None and engine.loras is not None  # abort raises
        return engine.loras

    async def LoadLoraAdapter(  # noqa: N802 (gRPC method name)
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterInfo:
        loras = await self._registry(context)
        if not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: must not be empty")
        if request.lora_name == self.parent:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {self.parent!r} is the base model's")
        try:  # reads the whole adapter and checks every value: off the event loop
            ref = await asyncio.to_thread(loras.add, request.lora_name, request.lora_path)
        except AdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {exc}")
            raise
        except AdapterExists as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"lora_name: {exc}")
            raise
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {exc}")
            raise
        return adapter_info(ref, self.parent)

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterInfo:
        loras = await self._registry(context)
        try:
            ref = loras.remove(request.lora_name)
        except UnknownAdapter:
            detail = f"lora_name: no LoRA adapter {request.lora_name!r} is loaded"
            await context.abort(grpc.StatusCode.NOT_FOUND, detail)
            raise
        return adapter_info(ref, self.parent)

    async def ListLoraAdapters(  # noqa: N802
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoraAdaptersResponse:
        engine = self.engine_now()
        refs = engine.loras.refs() if engine is not None and engine.loras is not None else []
        return pb.ListLoraAdaptersResponse(adapters=[adapter_info(r, self.parent) for r in refs])
