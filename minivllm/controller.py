"""ModelRouter: several models served in this process, each request sent to the model a function of yours picks.

    from minivllm import SamplingParams
    from minivllm.controller import ModelRouter

    router = ModelRouter()
    router.add_model("qwen-7b", "path/to/qwen")
    router.add_model("llama3-70b", "path/to/llama3")

    @router.route(strategy="latency")
    async def handle_request(request):
        if request.len < 100:
            return "qwen-7b"
        return "llama3-70b"

    output = await router.generate("Tell me a joke", SamplingParams(max_tokens=32))

The function's return value names the model (an unknown name is a RouteError NOT_FOUND naming it). `request.len`
is the prompt's length in tokens, by the tokenizer of the first model added (the function runs before a model is
chosen, so it sees one tokenization). Each model is an `LLM` (the same engine core as the servers), or several
with `add_model(..., replicas=N)`; `strategy` picks among a model's replicas with vllm-router's own strategies
(router_node/strategies.py): `latency` is the lowest expected time (seconds per output token measured on each
replica, times the request's max_tokens) times its open requests + 1; `least_loaded`, `round_robin`, `prefix` as
the router has them. With one replica per model the strategy has nothing to choose. In-process the router sees a
request's whole time, not its first token apart, so both of a replica's latency averages are its seconds per output
token. Models on other machines: vllm-router with `--routing-strategy module:function` (a function of the
request and the replicas, router_node/routing.py).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from minivllm.llm import LLM
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from router_node.replica import SERVING, Replica
from router_node.request import RouteRequest
from router_node.routing import RouteError
from router_node.strategies import Strategy, make_strategy
from scheduler_node.engine.model_path import resolve_model
from settings.router import ReplicaSpec

STRATEGIES = ("latency", "least_loaded", "round_robin", "prefix")  # the router's, but kv (it needs KV events)
PREFIX_CHARS, PREFIX_LOAD_FACTOR = 256, 1.25  # `prefix`: as vllm-router's defaults


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """What a routing function sees of a request."""

    prompt: str
    prompt_token_ids: list[int]  # by the first model's tokenizer
    sampling_params: SamplingParams
    priority: int | str | None = None

    @property
    def len(self) -> int:
        """The prompt's length in tokens."""
        return len(self.prompt_token_ids)


RouteFunction = Callable[[ModelRequest], "Awaitable[str] | str"]


@dataclass(slots=True)
class _Served:
    """One replica of a model: its engine and the router's view of it (what the strategies read)."""

    llm: LLM
    replica: Replica


class ModelRouter:
    """Models by name, each served by one or more in-process `LLM`s, and the function that picks one per request.
    Close it (or use `with`) to stop them."""

    def __init__(self, **settings: Any) -> None:
        """`settings`: engine settings every model is started with (`kv_cache_memory="64MiB"`, ...), as `LLM`'s."""
        self.settings = settings
        self.models: dict[str, list[_Served]] = {}
        self.function: RouteFunction | None = None
        self.strategy: Strategy = make_strategy("least_loaded", PREFIX_CHARS, PREFIX_LOAD_FACTOR)
        self._ports = itertools.count(1)  # an in-process replica's "address" is NAME#i:k, unique, never dialled

    def add_model(self, name: str, path: str, *, replicas: int = 1, **settings: Any) -> None:
        """Serve the model at `path` (a model folder, a GGUF file or a hub id, as `--model`) under `name`, on
        `replicas` engines; `settings` beside the router's. ValueError naming `name` or `path` when it cannot."""
        if not name or name in self.models:
            raise ValueError(f"name: {name!r} is {'taken' if name else 'empty'}; each model needs a name of its own")
        if replicas < 1:
            raise ValueError(f"replicas: must be at least 1, got {replicas}")
        try:
            folder = resolve_model(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"path: model {name!r} cannot be served from {path!r}: {exc}") from None
        served: list[_Served] = []
        try:
            for i in range(replicas):
                spec = ReplicaSpec(f"{name}#{i}:{next(self._ports)}", name)
                served.append(_Served(LLM(str(folder), **{**self.settings, **settings}), Replica(spec, SERVING)))
        except BaseException:
            for s in served:
                s.llm.close()
            raise
        self.models[name] = served

    def route(self, strategy: str = "least_loaded") -> Callable[[RouteFunction], RouteFunction]:
        """A decorator: the (async or plain) function it decorates returns the model each request goes to;
        `strategy` picks among that model's replicas. ValueError naming strategy when it is not one of STRATEGIES."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        chosen = make_strategy(strategy, PREFIX_CHARS, PREFIX_LOAD_FACTOR)

        def register(function: RouteFunction) -> RouteFunction:
            self.function, self.strategy = function, chosen
            return function

        return register

    async def generate(
        self, prompt: str, sampling_params: SamplingParams | None = None, priority: int | str | None = None
    ) -> RequestOutput:
        """The prompt's completion by the model the routing function names (the first model added when no
        function is registered). RouteError NOT_FOUND naming a model that was not added."""
        params = sampling_params or SamplingParams()
        name, request = await self.choose(prompt, params, priority)
        pick = self.strategy.choose(_route_request(name, request), [s.replica for s in self.models[name]])
        served = next(s for s in self.models[name] if s.replica is pick.replica)
        replica = served.replica
        replica.in_flight += 1
        replica.requests += 1
        start = time.monotonic()
        try:
            (output,) = await asyncio.to_thread(served.llm.generate, prompt, params, False, priority)
        finally:
            replica.in_flight -= 1
        tokens = max(1, max((len(c.token_ids) for c in output.outputs), default=1))
        per_token = (time.monotonic() - start) / tokens
        replica.observe_ttft(per_token)  # in-process: the whole time is seen, so both are per output token
        replica.observe_tpot(per_token)
        return output

    async def choose(
        self, prompt: str, params: SamplingParams, priority: int | str | None = None
    ) -> tuple[str, ModelRequest]:
        """The model the routing function names for this request, checked, and the request it saw."""
        if not self.models:
            raise RouteError("UNAVAILABLE", "no model: add one with add_model(name, path)")
        first = next(iter(self.models.values()))[0].llm
        request = ModelRequest(prompt, first.tokenizer.encode(prompt), params, priority)
        if self.function is None:
            return next(iter(self.models)), request
        answer = self.function(request)
        name = await answer if inspect.isawaitable(answer) else answer
        if name not in self.models:
            known = ", ".join(self.models)
            who = getattr(self.function, "__name__", "the routing function")
            raise RouteError("NOT_FOUND", f"model: {who} returned {name!r}, which is not added; models: {known}")
        return name, request

    def replicas(self, name: str) -> Sequence[Replica]:
        """The router's view of a model's replicas (open requests, latency averages)."""
        return [s.replica for s in self.models[name]]

    def close(self) -> None:
        """Stop every model's engines; idempotent."""
        for served in self.models.values():
            for s in served:
                s.llm.close()

    def __enter__(self) -> ModelRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _route_request(model: str, request: ModelRequest) -> RouteRequest:
    """What the router's strategies read of a request."""
    return RouteRequest(
        model=model,
        prompt=request.prompt,
        max_tokens=request.sampling_params.max_tokens,
        priority=request.priority,
    )
