"""gRPC security: TLS credentials (`--tls-cert/--tls-key`) and the Control service's bearer token."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from proto import serving_pb2 as pb

logger = logging.getLogger(__name__)

CONTROL_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["Control"].full_name + "/"


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """TLS for the gRPC port from PEM files; OSError naming the file when one cannot be read."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    chain, private = Path(cert).read_bytes(), Path(key).read_bytes()
    return grpc.ssl_server_credentials([(private, chain)])


class ControlAuth(grpc.aio.ServerInterceptor):
    """Control RPCs need `authorization: Bearer <token>` metadata; Generation, health and reflection do not."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the control token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not details.method.startswith(CONTROL_PREFIX):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return await continuation(details)
        logger.warning("refused %s: missing or wrong control token", details.method)
        return self._deny


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "the Control service needs metadata 'authorization: Bearer <--control-token>'"
    )
