"""The scheduler article's multi-GPU template in a `--config` file, mapped onto our settings:

    gpu_topology:                       # --topology, written inline: fast islands of devices
      - device_ids: [0, 1, 2, 3]
        interconnect: nvlink            # nvlink | pcie | loopback | network (scheduler_node/engine/topology.py)
      - device_ids: [4, 5, 6, 7]
        interconnect: pcie
    scheduling_policy:
      cross_device: round_robin         # --cross-device: data-parallel replicas on the islands in turn, routed in turn
      memory_sharing: enabled           # --memory-sharing: a replica pulls a prefix's KV blocks from a peer

`gpu_topology` becomes the `topology` setting as an inline mapping (its device kind: the command's --device, cpu
where the workers run on the CPU); placement reads it as it reads a topology file, and its errors name
gpu_topology. `scheduling_policy` as a mapping holds these two keys (as a name, fcfs or priority, it stays the
engine's queue policy). Bad keys or values are refused naming them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from settings.mixed_precision import on_cpu
from settings.setting import check, setting

GPU_TOPOLOGY = "gpu_topology"  # what load_topology names an inline topology (scheduler_node/engine/topology.py)
GROUP_KEYS = ("device_ids", "interconnect", "host")
CROSS_DEVICE = ("pack", "round_robin")
POLICY_KEYS = ("cross_device", "memory_sharing")
SWITCH = {"enabled": True, "disabled": False, True: True, False: False, "true": True, "false": False}


class TopologyKeyError(ValueError):
    """A gpu_topology or scheduling_policy key the engine cannot use (the message names it)."""


@dataclass(frozen=True, slots=True)
class CrossDevice:
    """How data-parallel replicas share the devices and each other's KV caches."""

    cross_device: str = setting(
        "pack",
        choices=CROSS_DEVICE,
        readers="serve",
        help="with --data-parallel-size and --topology: pack (each replica on what the previous left, first fit) or "
        "round_robin (each replica whole inside one island, the islands taken in turn, requests routed in turn)",
    )
    memory_sharing: bool = setting(
        False,
        readers="router",
        help="a replica chosen for a request whose prompt prefix another replica holds pulls those KV blocks from "
        "it (the KV transfer of disaggregated prefill) instead of recomputing them; needs 2+ replicas",
    )

    def __post_init__(self) -> None:
        check(self)


def topology_value(groups: Any, device: str | None) -> str:
    """The `topology` setting (an inline mapping, as JSON) that a `gpu_topology` list stands for."""
    if not isinstance(groups, list) or not groups:
        raise TopologyKeyError(f"{GPU_TOPOLOGY}: a list of {{device_ids, interconnect}}, got {groups!r}")
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TopologyKeyError(f"{GPU_TOPOLOGY}[{i}]: a mapping of {', '.join(GROUP_KEYS)}, got {group!r}")
        unknown = sorted(str(k) for k in set(group) - set(GROUP_KEYS))
        if unknown:
            raise TopologyKeyError(f"{GPU_TOPOLOGY}[{i}]: unknown key {unknown[0]!r}; expected {', '.join(GROUP_KEYS)}")
    kind = "cpu" if on_cpu(device or "auto") else "cuda"
    return json.dumps({"device": kind, "groups": groups}, separators=(",", ":"))


def policy_values(section: Any) -> dict[str, Any]:
    """The settings (`cross_device`, `memory_sharing`, and `routing_strategy` for round_robin) that a
    `scheduling_policy` mapping stands for."""
    unknown = sorted(str(k) for k in set(section) - set(POLICY_KEYS))
    if unknown:
        raise TopologyKeyError(f"scheduling_policy: unknown key {unknown[0]!r}; expected {', '.join(POLICY_KEYS)}")
    values: dict[str, Any] = {}
    cross = section.get("cross_device")
    if cross is not None:
        if cross not in CROSS_DEVICE:
            raise TopologyKeyError(f"scheduling_policy.cross_device: one of {', '.join(CROSS_DEVICE)}, got {cross!r}")
        values["cross_device"] = cross
        if cross == "round_robin":
            values["routing_strategy"] = "round_robin"
    sharing = section.get("memory_sharing")
    if sharing is not None:
        key = sharing.lower() if isinstance(sharing, str) else sharing
        if key not in SWITCH:
            raise TopologyKeyError(f"scheduling_policy.memory_sharing: enabled or disabled, got {sharing!r}")
        values["memory_sharing"] = SWITCH[key]
    return values
