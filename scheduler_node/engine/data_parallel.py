"""vllm-serve --data-parallel-size N: N replicas of the model, each its own vllm-scheduler and TP x PP world on
devices no other replica uses, behind one vllm-router.

With --topology, replica after replica is placed on what the previous ones left (first fit, so each TP group sits
inside one fast island and a replica that fills an island has it alone), or with --cross-device round_robin each
replica whole inside one island, the islands in turn; each scheduler gets a topology of just its own devices.
Without one, the workers of replica i see the i-th slice of the host's GPUs (CUDA_VISIBLE_DEVICES) and pick within
it as a single world's workers do. Replicas listen on loopback at free ports (the router is the door); the workers
of replica i join at --worker-port + i, or without one (vllm-serve's default, 0) at a free port each.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from proto.parallel import ParallelLayout
from scheduler_node.engine.placement import Placement, place
from scheduler_node.engine.ports import free_port
from scheduler_node.engine.topology import Group, Topology, TopologyError, single_island


@dataclass(slots=True)
class ReplicaPlan:
    index: int
    placement: Placement
    port: int  # its scheduler's gRPC port, on loopback
    worker_port: int
    topology_file: Path | None = None  # its own devices, when the user gave a topology
    worker_env: dict[str, str] = field(default_factory=dict)  # what its workers see (their GPU slice)
    http_port: int = 0  # its OpenAI API on loopback, behind the router's (0: off)
    kv_events_port: int = 0  # its KV events and snapshots on loopback, for the router's kv strategy (0: off)
    kv_snapshot_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def place_replicas(
    topology: Topology, layout: ParallelLayout, count: int, allow_cross_island: bool = False
) -> list[Placement]:
    """`count` placements of `layout` on disjoint devices of `topology`; TopologyError naming the replica that
    does not fit."""
    placements: list[Placement] = []
    free = topology
    for i in range(count):
        try:
            placement = place(free, layout, allow_cross_island)
        except TopologyError as exc:
            raise TopologyError(f"data-parallel replica {i + 1} of {count}: {exc}") from None
        mine = {(placement.topology.groups[r.slot.group].host, r.slot.device_id) for r in placement.ranks}
        placements.append(_with_topology(placement, _subset(free, mine, f"{topology.source} (replica {i})")))
        if i + 1 < count:
            rest = _subset(free, _devices(free) - mine, topology.source)
            if rest is None:
                raise TopologyError(
                    f"data-parallel replica {i + 2} of {count}: no device of {topology.source} is left "
                    f"(each replica needs {layout.world_size})"
                )
            free = rest
    return placements


def place_round_robin(topology: Topology, layout: ParallelLayout, count: int) -> list[Placement]:
    """`count` placements of `layout`, each whole inside one fast island, the islands taken in turn (the
    article's `cross_device: round_robin`): replica i sits on island i mod the number of islands while each has
    room. An island too small for one replica is an error naming it (the replicas would skip it unseen)."""
    world, source = layout.world_size, topology.source
    islands = [i for i, g in enumerate(topology.groups) if g.is_island]
    for i in islands:
        group = topology.groups[i]
        if len(group.device_ids) < world:
            raise TopologyError(
                f"{source}: cross_device round_robin places each replica (TP {layout.tensor_parallel_size} x PP "
                f"{layout.pipeline_parallel_size} = {world} devices) inside one island, and island {i} "
                f"{list(group.device_ids)} over {group.interconnect} has {len(group.device_ids)}"
            )
    if not islands:
        raise TopologyError(f"{source}: cross_device round_robin needs a fast island (nvlink, pcie, loopback)")
    free = {i: list(topology.groups[i].device_ids) for i in islands}
    placements: list[Placement] = []
    for r in range(count):
        turn = [islands[(r + k) % len(islands)] for k in range(len(islands))]
        island = next((i for i in turn if len(free[i]) >= world), None)
        if island is None:
            raise TopologyError(
                f"data-parallel replica {r + 1} of {count}: no island of {source} has {world} devices left"
            )
        ids, free[island] = free[island][:world], free[island][world:]
        group = topology.groups[island]
        mine = Topology(
            topology.device, (Group(group.host, group.interconnect, tuple(ids)),), f"{source} (replica {r})"
        )
        placements.append(place(mine, layout))
    return placements


def plan_replicas(
    count: int,
    layout: ParallelLayout,
    worker_port: int,
    topology: Topology | None,
    allow_cross_island: bool,
    gpus: bool,
    round_robin: bool = False,
) -> list[ReplicaPlan]:
    """Where each replica runs; `gpus`: its workers may use GPUs (so each replica gets its own slice of them);
    `worker_port`: replica i's workers join at worker_port + i (0: at a free port each); `round_robin`: each
    replica inside one island of `topology`, the islands in turn (else first fit)."""
    if count < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {count}")

    def joins_at(i: int) -> int:
        return worker_port + i if worker_port else free_port()

    if topology is None:
        one = place(single_island(layout.world_size), layout, worker_chooses_device=True)
        return [
            ReplicaPlan(i, one, free_port(), joins_at(i), None, _gpu_slice(i, layout.world_size) if gpus else {})
            for i in range(count)
        ]
    folder = Path(tempfile.mkdtemp(prefix="minivllm-dp-"))
    # Kept while this process lives (a restarted replica reads its file again), removed when it exits.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    plans = []
    placements = (
        place_round_robin(topology, layout, count)
        if round_robin
        else place_replicas(topology, layout, count, allow_cross_island)
    )
    for i, placement in enumerate(placements):
        path = folder / f"topology-{i}.yaml"
        path.write_text(yaml.safe_dump(topology_dict(placement.topology), sort_keys=False))
        plans.append(ReplicaPlan(i, placement, free_port(), joins_at(i), path))
    return plans


def topology_dict(topology: Topology) -> dict[str, Any]:
    """The topology as a --topology file holds it."""
    groups = []
    for g in topology.groups:
        group: dict[str, Any] = {"host": g.host} if g.host is not None else {}
        groups.append(group | {"interconnect": g.interconnect, "device_ids": list(g.device_ids)})
    return {"device": topology.device, "groups": groups}


def _devices(topology: Topology) -> set[tuple[str | None, int]]:
    return {(g.host, d) for g in topology.groups for d in g.device_ids}


def _subset(topology: Topology, keep: set[tuple[str | None, int]], source: str) -> Topology | None:
    """The topology with only the devices in `keep` (None when none is left)."""
    groups = []
    for g in topology.groups:
        ids = tuple(d for d in g.device_ids if (g.host, d) in keep)
        if ids:
            groups.append(Group(g.host, g.interconnect, ids))
    return Topology(topology.device, tuple(groups), source) if groups else None


def _with_topology(placement: Placement, topology: Topology | None) -> Placement:
    """The placement, described against the replica's own devices (what its scheduler will read)."""
    assert topology is not None  # it holds the devices the placement took
    return place(topology, placement.layout, placement.cross_island)


def _gpu_slice(index: int, world_size: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for replica `index`'s workers: its `world_size` GPUs of those this process sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range((index + 1) * world_size)]
    mine = ids[index * world_size : (index + 1) * world_size]
    if len(mine) < world_size:
        raise ValueError(
            f"data-parallel replica {index + 1} needs GPUs {index * world_size}..{(index + 1) * world_size - 1} of "
            f"CUDA_VISIBLE_DEVICES={visible}; give fewer replicas or a --topology"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
