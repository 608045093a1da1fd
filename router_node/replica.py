"""The schedulers a router fronts: what the config names (ReplicaSpec, settings/router.py) and what the router
knows of each (Replica).

A replica is one vllm-scheduler (with its own TP x PP world) serving one model under a name. Its state comes from
probes (grpc.health.v1) and from the streams the router sends it; its load from its Control.GetStats (polled) and
from the streams the router has open on it now (exact between two polls).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from settings.router import ReplicaSpec

logger = logging.getLogger(__name__)

STARTING, SERVING, NOT_SERVING, DOWN = "starting", "serving", "not_serving", "down"
EWMA_ALPHA = 0.3  # weight of the newest latency sample: a replica's slowdown shows within a few requests


@dataclass(slots=True)
class Load:
    """What the replica's last Control.GetStats said (zeros until the first answer)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    max_model_len: int = 0
    own_streams: int = 0  # the router's streams open on the replica when the answer came: counted in the two above


@dataclass(slots=True, eq=False)
class Replica:
    """The router's view of one scheduler. Strategies and user routing functions read it; the prober and the
    forwarding code write it."""

    spec: ReplicaSpec
    state: str = STARTING
    load: Load = field(default_factory=Load)
    in_flight: int = 0  # streams the router has open on it now
    requests: int = 0  # streams the router ever opened on it (retries included)
    ttft_ewma: float | None = None  # seconds, measured by the router (None until a first token came back)
    tpot_ewma: float | None = None
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it serves (its Control.ListLoraAdapters)
    # Times it became SERVING: one that drained and came back at its address (a rolling restart) is a new scheduler,
    # a target again for the requests it handed back.
    epoch: int = 0

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def weight(self) -> float:
        return self.spec.weight

    @property
    def others(self) -> int:
        """Requests of the replica's other clients, as of the last poll: its queue less the router's own streams
        then open on it."""
        return max(0, self.load.num_running + self.load.num_waiting - self.load.own_streams)

    @property
    def queue(self) -> int:
        """Requests ahead of a new one: the router's own open streams (exact now) and the other clients' (as polled).
        The poll lags both a burst and the end of one; counting the router's streams from its own ledger keeps a
        replica whose streams just ended from looking busy until its next poll."""
        return self.in_flight + self.others

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_ewma = _ewma(self.ttft_ewma, seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot_ewma = _ewma(self.tpot_ewma, seconds)


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else EWMA_ALPHA * sample + (1 - EWMA_ALPHA) * current


class ReplicaPool:
    """Every replica, grouped by model in config order; `changed` is set whenever a replica's state changes."""

    def __init__(self, specs: Iterable[ReplicaSpec]) -> None:
        self.replicas = [Replica(spec) for spec in specs]
        if not self.replicas:
            raise ValueError("no replicas: give at least one --replica HOST:PORT,model=NAME")
        seen: set[str] = set()
        for r in self.replicas:
            if r.address in seen:
                raise ValueError(f"replica {r.address} is listed twice")
            seen.add(r.address)
        self.models = list(dict.fromkeys(r.model for r in self.replicas))
        self.changed = asyncio.Event()

    def of_model(self, model: str) -> list[Replica]:
        return [r for r in self.replicas if r.model == model]

    def serving(self, model: str | None = None) -> list[Replica]:
        """The replicas that take requests (of `model`, or of every model)."""
        return [r for r in self.replicas if r.state == SERVING and (model is None or r.model == model)]

    def set_state(self, replica: Replica, state: str, why: str = "") -> None:
        if replica.state == state:
            return
        log = logger.info if state == SERVING else logger.warning
        because = f" ({why})" if why else ""
        log("replica %s (%s): %s -> %s%s", replica.address, replica.model, replica.state, state, because)
        replica.state = state
        replica.epoch += state == SERVING
        self.changed.set()

    @property
    def every_model_served(self) -> bool:
        return all(self.serving(model) for model in self.models)
