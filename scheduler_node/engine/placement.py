"""Placement: which device of the topology each rank gets, and which joining worker becomes which rank.

Each pipeline stage's tensor-parallel group goes inside one fast island (first fit, in file order); stages
follow one another across whatever links are left, so only pipeline traffic (one hidden state per step) crosses
slower links. A TP group that fits no island is an error unless `--allow-cross-island`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from proto.parallel import ParallelLayout
from proto.wire import WorkerHello
from scheduler_node.engine.topology import SPEED, Topology, TopologyError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slot:
    group: int  # index into topology.groups
    device_id: int


@dataclass(frozen=True, slots=True)
class RankPlacement:
    rank: int
    stage: int
    tp_rank: int
    slot: Slot
    host: str | None
    device: str  # what the Assignment carries: "cuda:3", "cpu", or "" (the worker decides)


@dataclass(slots=True)
class Placement:
    layout: ParallelLayout
    topology: Topology
    ranks: list[RankPlacement]
    tp_links: list[str]  # per stage: the interconnect its TP all-reduces use
    pp_links: list[str]  # per stage boundary s → s+1
    cross_island: bool = False
    worker_chooses_device: bool = False

    def describe(self) -> str:
        t, p = self.layout.tensor_parallel_size, self.layout.pipeline_parallel_size
        lines = [
            f"placement of TP {t} x PP {p} = {self.layout.world_size} rank(s) on {self.topology.source} "
            f"({self.topology.num_devices} device(s)); output rank {self.layout.output_rank}",
            f"{'rank':>4}  {'stage':>5}  {'tp':>2}  {'host':<16} {'device':<10} group",
        ]
        for r in self.ranks:
            device, host = r.device or "(worker's own)", r.host or "(any)"
            lines.append(f"{r.rank:>4}  {r.stage:>5}  {r.tp_rank:>2}  {host:<16} {device:<10} {r.slot.group}")
        for stage, link in enumerate(self.tp_links):
            lines.append(f"stage {stage}: tensor parallel over {link}")
        for stage, link in enumerate(self.pp_links):
            lines.append(f"stage {stage} -> {stage + 1}: pipeline over {link}")
        if self.cross_island:
            lines.append("warning: a tensor-parallel group spans islands (--allow-cross-island)")
        return "\n".join(lines)


def place(
    topology: Topology, layout: ParallelLayout, allow_cross_island: bool = False, worker_chooses_device: bool = False
) -> Placement:
    t, p = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if layout.world_size > topology.num_devices:
        raise TopologyError(
            f"TP {t} x PP {p} needs {layout.world_size} devices; {topology.source} has {topology.num_devices}"
        )
    free = {g: list(group.device_ids) for g, group in enumerate(topology.groups)}
    stages: list[list[Slot]] = []
    cross = False
    for stage in range(p):
        group = next((g for g in free if topology.groups[g].is_island and len(free[g]) >= t), None)
        if group is None and t == 1:
            group = next(g for g in free if free[g])
        if group is not None:
            stages.append([Slot(group, free[group].pop(0)) for _ in range(t)])
            continue
        if not allow_cross_island:
            raise TopologyError(_no_island_message(topology, free, t, stage))
        cross = True
        spread: list[Slot] = []
        for g in free:
            while free[g] and len(spread) < t:
                spread.append(Slot(g, free[g].pop(0)))
        stages.append(spread)
    ranks = []
    for stage, slots in enumerate(stages):
        for tp_rank, slot in enumerate(slots):
            host = topology.groups[slot.group].host
            device = "" if worker_chooses_device else _device(topology.device, slot.device_id)
            ranks.append(RankPlacement(stage * t + tp_rank, stage, tp_rank, slot, host, device))
    tp_links = [_slowest(topology, [s.group for s in slots]) for slots in stages]
    pp_links = [
        _slowest_pairs(topology, [(a.group, b.group) for a, b in zip(stages[s], stages[s + 1])]) for s in range(p - 1)
    ]
    return Placement(layout, topology, ranks, tp_links, pp_links, cross, worker_chooses_device)


def _device(kind: str, device_id: int) -> str:
    return f"cuda:{device_id}" if kind == "cuda" else "cpu"


def _slowest(topology: Topology, groups: list[int]) -> str:
    return _slowest_pairs(topology, [(groups[0], g) for g in groups]) if groups else "none"


def _slowest_pairs(topology: Topology, pairs: list[tuple[int, int]]) -> str:
    links = [topology.link_between(a, b) for a, b in pairs]
    return min(links, key=lambda link: SPEED[link])


def _no_island_message(topology: Topology, free: dict[int, list[int]], t: int, stage: int) -> str:
    islands = [
        f"{g.host or 'this host'} {list(g.device_ids)} over {g.interconnect} ({len(free[i])} free)"
        for i, g in enumerate(topology.groups)
        if g.is_island
    ]
    biggest = max((len(g.device_ids) for g in topology.groups if g.is_island), default=1)
    return (
        f"the tensor-parallel group of stage {stage} needs {t} devices inside one fast island (nvlink, pcie, "
        f"loopback), and none is left in {topology.source}: islands are {'; '.join(islands) or 'none'}. "
        f"Use --tensor-parallel-size <= {biggest} (and more --pipeline-parallel-size), or pass "
        "--allow-cross-island to let tensor-parallel traffic cross slower links"
    )


def _same_host(topology_host: str | None, hostname: str, address: str) -> bool:
    """A worker is on a topology host named by its address, its hostname, or a DNS name whose first label is its
    hostname (a Kubernetes StatefulSet pod `worker-0` is reached as `worker-0.<headless service>`)."""
    if topology_host is None or topology_host in (hostname, address):
        return True
    return "." in topology_host and topology_host.split(".", 1)[0] == hostname


@dataclass(slots=True)
class RankAssigner:
    """Hands each joining worker the lowest free rank whose host it matches (by hostname or address)."""

    placement: Placement
    addresses: dict[int, str] = field(default_factory=dict)  # rank -> the address its worker connected from
    devices: dict[int, str] = field(default_factory=dict)  # rank -> the device its Assignment names
    _hosts: dict[int, str] = field(default_factory=dict)

    def claim(self, hello: WorkerHello, address: str, free: Sequence[int]) -> int | None:
        for rank in sorted(free):
            r = self.placement.ranks[rank]
            if not _same_host(r.host, hello.host, address):
                continue
            self.addresses[rank] = address
            self._hosts[rank] = f"{hello.host}/{address}"
            self.devices[rank] = r.device or self._worker_device(hello, rank, free)
            return rank
        return None

    def _worker_device(self, hello: WorkerHello, rank: int, free: Sequence[int]) -> str:
        """Without a topology: number the GPUs of one host in join order; CPU workers keep their own."""
        if hello.device != "cuda":
            return ""
        host = self._hosts[rank]
        used = {d for r, d in self.devices.items() if r != rank and r not in free and self._hosts.get(r) == host}
        return next(f"cuda:{i}" for i in range(len(self.placement.ranks)) if f"cuda:{i}" not in used)

    @property
    def rendezvous_host(self) -> str:
        """Where rank 0 opens the torch.distributed store: its topology host, else the address it joined from.

        Ranks are claimed lowest first, so when rank 0 has no host in the topology it is the first to join.
        """
        return self.placement.ranks[0].host or self.addresses.get(0) or "127.0.0.1"
