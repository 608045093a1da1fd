"""`vllm-serve --launcher ray`: the workers as Ray actors, placed by a placement group that follows the layout.

Each pipeline stage gets its own placement group of TP bundles with STRICT_PACK, so a tensor-parallel group
always sits on one node while stages may spread over nodes. From where the bundles landed the launcher writes
the scheduler's topology (one group per node, `host` = the node's IP), so the scheduler hands every rank of a TP
group to workers on that node, and each actor runs `vllm-worker --local-address <node IP>` in its own process,
connecting back to the scheduler as any worker does. On GPU nodes every actor of a node sees the node's reserved
GPUs (CUDA_VISIBLE_DEVICES) and the scheduler's topology picks one for each rank. An actor that dies is replaced
in the same bundle (with the local launcher's back-off), and its replacement rejoins the lost rank. `stop` kills
the actors, removes the placement groups and leaves Ray. Ray is imported only here.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from proto.parallel import ParallelLayout
from scheduler_node.engine.processes import Restarts

logger = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")


class RankActor:
    """One rank's worker, run inside the actor's own process: killing the actor kills the worker."""

    def where(self) -> tuple[str, list[str]]:
        """The node this actor runs on, and the GPUs Ray gave it."""
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """vllm-worker's main with these flags, until it exits; its exit code."""
        os.environ.update(env)  # before torch initialises CUDA
        from worker_node.worker import main

        return main(argv)


@dataclass
class Slot:
    """One rank's bundle and the actor in it."""

    group: Any  # the stage's PlacementGroup
    bundle: int
    actor: Any = None
    running: Any = None  # the ObjectRef of actor.run: ready when the worker exited or the actor died
    node_ip: str = ""
    restarts: Restarts = field(default_factory=Restarts)


class RayLauncher:
    gave_up = ""  # an actor is always replaced (a stalled one is not detected here: Ray does not see it)

    def __init__(self, args: argparse.Namespace, layout: ParallelLayout) -> None:
        import ray

        if args.topology:
            raise ValueError("--topology: with --launcher ray the placement group decides where ranks go; drop it")
        self.ray = ray
        ray.init(address=args.ray_address, include_dashboard=False, configure_logging=False)
        self.layout = layout
        self.gpu = args.device.startswith("cuda") or (args.device == "auto" and ray.cluster_resources().get("GPU"))
        bundle = {"CPU": float(max(1, args.threads))} | ({"GPU": 1.0} if self.gpu else {})
        from ray.util.placement_group import placement_group

        t, p = layout.tensor_parallel_size, layout.pipeline_parallel_size
        self.groups = [placement_group([bundle] * t, strategy="STRICT_PACK") for _ in range(p)]
        ready = [g.ready() for g in self.groups]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=args.worker_join_timeout)
        if len(done) < len(ready):
            self._leave()
            raise ValueError(
                f"the Ray cluster cannot place {p} stage(s) of {t} bundle(s) {bundle} each, every stage on one "
                f"node, within {args.worker_join_timeout:g} s; resources: {ray.available_resources()}"
            )
        self.slots = [Slot(g, i) for g in self.groups for i in range(t)]
        self.actor_class = ray.remote(RankActor)
        for slot in self.slots:
            slot.actor = self._actor(slot)
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        where = ray.get([slot.actor.where.remote() for slot in self.slots])
        self.topology, self.env = self._topology(nodes, where)
        self.topology_file = Path(tempfile.mkdtemp(prefix="minivllm-ray-")) / "topology.yaml"
        self.topology_file.write_text(yaml.safe_dump(self.topology, sort_keys=False))
        here = ray.get_runtime_context().get_node_id()
        self.driver_ip = nodes.get(here, "127.0.0.1")
        self.argv: list[str] = []
        logger.info("placed %d rank(s) by Ray: %s", len(self.slots), self.topology)

    def _actor(self, slot: Slot) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(slot.group, placement_group_bundle_index=slot.bundle)
        resources = slot.group.bundle_specs[slot.bundle]
        return self.actor_class.options(
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0), scheduling_strategy=strategy
        ).remote()

    def _topology(
        self, nodes: dict[str, str], where: list[tuple[str, list[str]]]
    ) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
        """The scheduler's topology (one group per node, in the order of the ranks) and each node's environment."""
        per_node: dict[str, list[str]] = {}
        for slot, (node_id, gpus) in zip(self.slots, where):
            slot.node_ip = nodes[node_id]
            per_node.setdefault(slot.node_ip, []).extend(gpus)
        groups = []
        env: dict[str, dict[str, str]] = {}
        for ip, gpus in per_node.items():
            size = sum(1 for s in self.slots if s.node_ip == ip)
            interconnect = "pcie" if self.gpu else "loopback"
            groups.append({"host": ip, "interconnect": interconnect, "device_ids": list(range(size))})
            env[ip] = {"CUDA_VISIBLE_DEVICES": ",".join(sorted(gpus, key=lambda g: (len(g), g)))} if self.gpu else {}
        return {"device": "cuda" if self.gpu else "cpu", "groups": groups}, env

    def scheduler_flags(self) -> list[str]:
        return ["--topology", str(self.topology_file)]

    def start(self, scheduler_address: str, worker_flags: list[str]) -> None:
        host, _, port = scheduler_address.rpartition(":")
        if host in WILDCARDS:
            host = self.driver_ip  # the scheduler listens everywhere: reach it at this node's IP
        self.argv = ["--scheduler-address", f"{host}:{port}", *worker_flags]
        for slot in self.slots:
            self._run(slot)

    def _run(self, slot: Slot) -> None:
        argv = [*self.argv, "--local-address", slot.node_ip]  # the scheduler matches ranks by it
        slot.running = slot.actor.run.remote(argv, self.env[slot.node_ip])

    def keep_alive(self) -> None:
        for slot in self.slots:
            done, _ = self.ray.wait([slot.running], timeout=0)
            if done and slot.restarts.due(f"the worker actor of bundle {slot.bundle} {self._ended(slot)}"):
                self.ray.kill(slot.actor, no_restart=True)
                slot.actor = self._actor(slot)
                self._run(slot)

    def _ended(self, slot: Slot) -> str:
        try:
            return f"exited with {self.ray.get(slot.running)}"
        except self.ray.exceptions.RayActorError as exc:
            return f"died ({type(exc).__name__})"

    def stop(self, grace: float) -> None:
        running = [s.running for s in self.slots if s.running is not None]
        self.ray.wait(running, num_returns=len(running), timeout=grace)
        for slot in self.slots:
            self.ray.kill(slot.actor, no_restart=True)
        self._leave()
        self.topology_file.unlink(missing_ok=True)
        self.topology_file.parent.rmdir()

    def _leave(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.ray.shutdown()
