"""How a gRPC door (a scheduler's or the router's) refuses a call: the status set on the context, not raised."""

from __future__ import annotations

import grpc

from scheduler_node.api.openai_errors import RETRY_AFTER_S

RETRY_AFTER = (("retry-after", str(RETRY_AFTER_S)),)  # trailing metadata of an UNAVAILABLE answer


def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, detail: str) -> None:
    """End the call with `code` once the handler returns. Not `context.abort`: the exception it raises holds the
    handler's frame, and so the request, in a cycle with the call's state that only a full garbage collection
    breaks (the scheduler runs those when idle after work): refused requests piled up, 60 MiB each."""
    context.set_code(code)
    context.set_details(detail)
    if code == grpc.StatusCode.UNAVAILABLE:
        context.set_trailing_metadata(RETRY_AFTER)
