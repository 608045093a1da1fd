"""An example of a user-written routing function: requests for the model "auto" get a model by their prompt's size.

    vllm-router --routing-strategy deploy.custom_route:by_prompt_size \\
        --replica 127.0.0.1:50051,model=small --replica 127.0.0.1:50052,model=large

Short prompts go to SMALL, long ones to LARGE; a request that names a model keeps it. The function sees the request
and every serving replica (address, model, weight, state, load, in_flight, ttft_ewma, tpot_ewma) and may return
one of them, a model name (the router picks among its replicas by least_loaded), or None (the request's own model).
The module only needs to be importable by the router (on PYTHONPATH or installed).
"""

from __future__ import annotations

from collections.abc import Sequence

from router_node.replica import Replica
from router_node.request import CHARS_PER_TOKEN, RouteRequest

SMALL, LARGE = "small", "large"
LONG_PROMPT_CHARS = 2000


def by_prompt_size(request: RouteRequest, replicas: Sequence[Replica]) -> str | None:
    if request.model != "auto":
        return None
    chars = len(request.prompt) + sum(len(content) for _, content in request.messages)
    chars += len(request.prompt_token_ids) * CHARS_PER_TOKEN
    return LARGE if chars >= LONG_PROMPT_CHARS else SMALL
