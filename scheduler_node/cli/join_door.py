"""The answer, on the scheduler's gRPC port, to "where do workers join?" (proto WORKER_JOIN_PATH): article 003
points workers at `vllm-scheduler --port`, the gRPC port, while they join on the ZeroMQ socket at --worker-host:
--worker-port. A worker asks once, with bare HTTP/2 frames (worker_node/join_address.py); the answer is that
socket's HOST:PORT as UTF-8 bytes (no protobuf: nothing but a worker asks)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.session_messages import WORKER_JOIN_PATH

SERVICE, METHOD = WORKER_JOIN_PATH.strip("/").split("/")


def join_handler(endpoint: str) -> grpc.GenericRpcHandler:
    """The gRPC handler that answers WORKER_JOIN_PATH with `endpoint` (the workers' HOST:PORT)."""
    answer = endpoint.encode()

    def where(request: bytes, context: object) -> bytes:
        return answer

    method = grpc.unary_unary_rpc_method_handler(where, request_deserializer=None, response_serializer=None)
    return grpc.method_handlers_generic_handler(SERVICE, {METHOD: method})


async def start_join_door(address: str, endpoint: str) -> grpc.aio.Server:
    """A gRPC server on `address` (HOST:PORT) answering only WORKER_JOIN_PATH: what a scheduler without --model
    serves while it waits for its first worker to name the model (its own gRPC server needs the model's
    tokenizer). OSError when the port cannot be bound."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((join_handler(endpoint),))
    # Health answers NOT_SERVING meanwhile (not UNIMPLEMENTED): a liveness probe waits, as for a world assembling.
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's word for a port in use
        raise OSError(f"cannot bind gRPC on {address}: {exc}") from None
    if not bound:
        raise OSError(f"cannot bind gRPC on {address}")
    await server.start()
    await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server
