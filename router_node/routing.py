"""The routing decision, door-neutral: a RouteRequest -> the model and the replica to send it to, or a RouteError
whose code is a gRPC status name (an HTTP door maps NOT_FOUND to 404, UNAVAILABLE to 503).

A user's routing function (`--routing-strategy module:function`) sees the request and every serving replica, and returns
a replica (of any model: the request goes to that replica's model), a model name (its replicas are then compared
by `least_loaded`), or None (the request's own model, by `least_loaded`).

A request may name a LoRA adapter instead of a model: it goes to the serving replicas that list it
(`Replica.adapters`, learned by the prober), under the adapter's name.

    def route(request: RouteRequest, replicas: Sequence[Replica]) -> Replica | str | None
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from router_node.kv_load import Ticket
from router_node.metrics import RouterMetrics
from router_node.replica import Replica, ReplicaPool
from router_node.request import RouteRequest
from router_node.strategies import LeastLoaded, Pick, Strategy, make_strategy
from settings.plugins import load_named
from settings.router import DEFAULT_LOAD_FACTOR

logger = logging.getLogger(__name__)

RoutingFunction = Callable[[RouteRequest, Sequence[Replica]], "Replica | str | None"]


class RouteError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # a gRPC status name: NOT_FOUND, UNAVAILABLE


@dataclass(frozen=True, slots=True)
class Route:
    replica: Replica
    decision: str
    adapter: str = ""  # a LoRA adapter of the replica's model that the request names
    ticket: Ticket | None = None  # `kv`: ended (Forwarder.closed) when the request's stream on the replica closes

    @property
    def model(self) -> str:
        """The name the replica is sent: the adapter's, else its model's."""
        return self.adapter or self.replica.model


def load_function(spec: str) -> RoutingFunction:
    function = load_named(spec, "routing function")
    if not callable(function):
        raise ValueError(f"routing function {spec!r} is not callable")
    return function  # type: ignore[no-any-return]


class Router:
    def __init__(
        self,
        pool: ReplicaPool,
        strategy: str,
        default_model: str = "",
        prefix_chars: int = 256,
        prefix_load_factor: float = DEFAULT_LOAD_FACTOR,
        metrics: RouterMetrics | None = None,
        kv: Strategy | None = None,
    ) -> None:
        self.pool = pool
        self.default_model = default_model or pool.models[0]
        if self.default_model not in pool.models:
            raise ValueError(f"--default-model {self.default_model!r} is not served by any replica: {pool.models}")
        self.function: RoutingFunction | None = load_function(strategy) if ":" in strategy else None
        if self.function:
            self.strategy: Strategy = LeastLoaded()
        elif strategy == "kv" and kv is not None:
            self.strategy = kv  # built over the KV events' index (router_node/main.py)
        else:
            self.strategy = make_strategy(strategy, prefix_chars, prefix_load_factor)
        self.strategy_name = strategy if self.function else self.strategy.name
        self.metrics = metrics

    def route(self, request: RouteRequest, exclude: Collection[Replica] = ()) -> Route:
        """Where `request` goes, skipping the replicas in `exclude` (a retry's failed one)."""
        if self.function is not None:
            pick = self._by_function(request, exclude)
        else:
            pick = self.strategy.choose(request, self._candidates(request.model or self.default_model, exclude))
        if self.metrics is not None:
            self.metrics.decided(self.strategy_name, pick.decision)
        own = request.model or self.default_model
        adapter = own if own not in self.pool.models and own in pick.replica.adapters else ""
        return Route(pick.replica, pick.decision, adapter, pick.ticket)

    def _candidates(self, model: str, exclude: Collection[Replica]) -> list[Replica]:
        """The serving replicas of `model`: a model's, or those that serve a LoRA adapter of that name."""
        if model in self.pool.models:
            candidates = [r for r in self.pool.serving(model) if r not in exclude]
        elif any(model in r.adapters for r in self.pool.replicas):
            candidates = [r for r in self.pool.serving() if model in r.adapters and r not in exclude]
        else:
            models = ", ".join(self.pool.models)
            raise RouteError("NOT_FOUND", f"model: {model!r} is not served here; models: {models} and their LoRA "
                             "adapters")  # fmt: skip
        if not candidates:
            other = " other" if exclude else ""
            raise RouteError("UNAVAILABLE", f"model {model!r}: no{other} replica is serving")
        return candidates

    def _by_function(self, request: RouteRequest, exclude: Collection[Replica]) -> Pick:
        assert self.function is not None
        serving = [r for r in self.pool.serving() if r not in exclude]
        own = request.model or self.default_model
        try:
            answer = self.function(request, serving)
        except Exception:  # a bug in the user's function must not take the router down
            logger.exception("routing function failed; routing by least_loaded")
            return self._least_loaded(request, own, exclude, "function_error")
        if isinstance(answer, Replica) and answer in serving:
            return Pick(answer, "function_replica")
        if isinstance(answer, str):
            return self._least_loaded(request, answer, exclude, "function_model")
        if answer is None:
            return self._least_loaded(request, own, exclude, "function_default")
        logger.error("routing function returned %r, not a serving replica, a model name or None; routing by "
                     "least_loaded", answer)  # fmt: skip
        return self._least_loaded(request, own, exclude, "function_error")

    def _least_loaded(self, request: RouteRequest, model: str, exclude: Collection[Replica], decision: str) -> Pick:
        return Pick(self.strategy.choose(request, self._candidates(model, exclude)).replica, decision)
