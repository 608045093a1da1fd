"""Topology files: which devices exist, on which hosts, and how fast they talk (`--topology FILE.yaml`).

    device: cuda                  # cuda (device_ids are GPU indices) or cpu (device_ids are CPU shard slots)
    groups:                       # each group is a set of devices joined by one interconnect
      - host: node-a              # optional: the hostname or IP its workers report/connect from
        interconnect: nvlink      # nvlink | pcie | loopback (CPU processes on one host) | network
        device_ids: [0, 1, 2, 3]

A group on nvlink, pcie or loopback is a fast island: a tensor-parallel group must sit inside one. Devices of
different groups on one host talk over PCIe (loopback on CPU); devices on different hosts over the network. A
group whose own interconnect is `network` is a set of devices with no fast link between them. A `--config` file's
`gpu_topology` list (the scheduler article's template) is the same groups, passed inline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Faster links rank higher; placement compares them.
SPEED = {"nvlink": 3, "pcie": 2, "loopback": 2, "network": 1}
DEVICES = ("cuda", "cpu")


class TopologyError(ValueError):
    """A topology file that cannot be used, or a layout that does not fit it."""


@dataclass(frozen=True, slots=True)
class Group:
    host: str | None  # None: any host (a single-host file)
    interconnect: str
    device_ids: tuple[int, ...]

    @property
    def is_island(self) -> bool:
        return self.interconnect != "network"


@dataclass(frozen=True, slots=True)
class Topology:
    device: str
    groups: tuple[Group, ...]
    source: str = ""  # the file it came from, for messages

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise TopologyError(f"{self._name}: device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not self.groups:
            raise TopologyError(f"{self._name}: no groups")
        seen: set[tuple[str | None, int]] = set()
        for g in self.groups:
            if g.interconnect not in SPEED:
                raise TopologyError(f"{self._name}: interconnect {g.interconnect!r} is not one of {', '.join(SPEED)}")
            if not g.device_ids:
                raise TopologyError(f"{self._name}: a group on {g.host or 'this host'} has no device_ids")
            for d in g.device_ids:
                if d < 0:
                    raise TopologyError(f"{self._name}: device id {d} is negative")
                if (g.host, d) in seen:
                    raise TopologyError(f"{self._name}: device {d} on {g.host or 'this host'} is listed twice")
                seen.add((g.host, d))

    @property
    def _name(self) -> str:
        return self.source or "topology"

    @property
    def num_devices(self) -> int:
        return sum(len(g.device_ids) for g in self.groups)

    def link_between(self, a: int, b: int) -> str:
        """The interconnect between a device of group `a` and one of group `b`."""
        ga, gb = self.groups[a], self.groups[b]
        if a == b:
            return ga.interconnect
        if ga.host != gb.host:
            return "network"
        return "loopback" if self.device == "cpu" else "pcie"


def single_island(world_size: int) -> Topology:
    """No file: every worker in one fast island on any host; each worker picks its own device."""
    return Topology("cpu", (Group(None, "loopback", tuple(range(world_size))),), "the default topology")


def load_topology(path: str | Path) -> Topology:
    """A topology file, or a mapping written inline (what a config file's `gpu_topology` becomes:
    settings/topology.py), whose errors name gpu_topology."""
    if isinstance(path, str) and path.lstrip().startswith("{"):
        try:
            return parse_topology(yaml.safe_load(path), "gpu_topology")
        except yaml.YAMLError as exc:
            raise TopologyError(f"gpu_topology: {exc}") from exc
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TopologyError(f"cannot read topology {path}: {exc}") from exc
    return parse_topology(data, str(path))


def parse_topology(data: Any, source: str = "topology") -> Topology:
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a mapping with 'groups'")
    unknown = set(data) - {"device", "groups"}
    if unknown:
        raise TopologyError(f"{source}: unknown keys {sorted(unknown)}; expected device, groups")
    groups = data.get("groups")
    if not isinstance(groups, list):
        raise TopologyError(f"{source}: 'groups' must be a list of {{host, interconnect, device_ids}}")
    return Topology(str(data.get("device", "cuda")), tuple(_group(g, source, i) for i, g in enumerate(groups)), source)


def _group(g: Any, source: str, index: int) -> Group:
    where = f"{source}[{index}]" if source == "gpu_topology" else f"{source}: groups[{index}]"
    if not isinstance(g, dict):
        raise TopologyError(f"{where} must be a mapping")
    unknown = set(g) - {"host", "interconnect", "device_ids"}
    if unknown:
        raise TopologyError(f"{where}: unknown keys {sorted(unknown)}; expected host, interconnect, device_ids")
    ids = g.get("device_ids")
    if not isinstance(ids, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in ids):
        raise TopologyError(f"{where}: device_ids must be a list of integers")
    if "interconnect" not in g:
        raise TopologyError(f"{where}: interconnect is missing ({', '.join(SPEED)})")
    host = g.get("host")
    return Group(None if host is None else str(host), str(g["interconnect"]), tuple(ids))
