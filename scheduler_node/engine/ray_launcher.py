"""`vllm-serve --launcher ray`: the workers as Ray actors, placed by a placement group that follows the layout.

Each pipeline stage gets its own placement group of TP bundles with STRICT_PACK, so a tensor-parallel group
always sits on one node while stages may spread over nodes. From where the bundles landed the launcher writes
the scheduler's topology (one group per node, `host` = the node's IP), so the scheduler hands every rank of a TP
group to workers on that node, and each actor runs `vllm-worker --local-address <node IP>` in its own process,
connecting back to the scheduler as any worker does. On GPU nodes every actor of a node sees the node's reserved
GPUs (CUDA_VISIBLE_DEVICES) and the scheduler's topology picks one for each rank. An actor that dies is replaced
in the same bundle (with the local launcher's back-off), and its replacement rejoins the lost rank. `stop` kills
the actors, removes the placement groups and leaves Ray. Ray is imported only here.

A stalled actor (SIGSTOP, a hang with the GIL held, a close that never returns) is replaced too, by the local
launcher's rule (proto/liveness.py): the worker beats on a liveness pipe inside its actor, and the actor (threaded,
so a second thread answers while `run` blocks) reports on `ping` how long the beats have been silent. A ping
unanswered, or answered "silent", for longer than the bound that applies (`--worker-join-timeout` while the worker
joins, `--heartbeat-timeout` once ready) gets the actor killed, and so replaced.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from proto.liveness import LIVENESS_FD_ENV, Pulse
from proto.parallel import ParallelLayout
from scheduler_node.engine.processes import Restarts

logger = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")
PING_INTERVAL_S = 1.0  # how often the launcher asks each actor whether its worker still beats


class RankActor:
    """One rank's worker, run inside the actor's own process: killing the actor kills the worker. Threaded (two
    threads): `ping` is answered while `run` blocks."""

    def __init__(self) -> None:
        self.pulse: Pulse | None = None

    def where(self) -> tuple[str, list[str]]:
        """The node this actor runs on, and the GPUs Ray gave it."""
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def run(self, argv: list[str], env: dict[str, str], join_timeout: float, heartbeat_timeout: float) -> int:
        """vllm-worker's main with these flags, until it exits; its exit code."""
        self.pulse = Pulse(join_timeout, heartbeat_timeout)  # the worker's Beats write into it, in this process
        os.environ.update({**env, LIVENESS_FD_ENV: str(self.pulse.write_fd)})  # before torch initialises CUDA
        from worker_node.worker import main

        return main(argv)

    def ping(self) -> tuple[float, bool]:
        """Seconds the worker's beats have been silent past their bound (0: alive), and whether it joined."""
        if self.pulse is None:
            return 0.0, False
        return self.pulse.stalled_for(), self.pulse.ready


@dataclass
class Slot:
    """One rank's bundle and the actor in it."""

    group: Any  # the stage's PlacementGroup
    bundle: int
    actor: Any = None
    running: Any = None  # the ObjectRef of actor.run: ready when the worker exited or the actor died
    node_ip: str = ""
    restarts: Restarts = field(default_factory=Restarts)
    ping: Any = None  # the ObjectRef of the unanswered actor.ping, if any
    asked: float = 0.0  # when it was sent
    answered: float = field(default_factory=time.monotonic)  # when the last ping was answered
    ready: bool = False  # the last answer said the worker joined


class RayLauncher:
    gave_up = ""  # an actor is always replaced

    def __init__(self, args: argparse.Namespace, layout: ParallelLayout) -> None:
        import ray

        if args.topology:
            raise ValueError("--topology: with --launcher ray the placement group decides where ranks go; drop it")
        self.ray = ray
        ray.init(address=args.ray_address, include_dashboard=False, configure_logging=False)
        self.layout = layout
        self.join_timeout, self.heartbeat_timeout = args.worker_join_timeout, args.heartbeat_timeout
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
            num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0),
            scheduling_strategy=strategy,
            max_concurrency=2,  # threaded: `ping` is answered while `run` blocks
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
        env = self.env[slot.node_ip]
        slot.running = slot.actor.run.remote(argv, env, self.join_timeout, self.heartbeat_timeout)
        slot.ping, slot.answered, slot.ready = None, time.monotonic(), False

    def keep_alive(self) -> None:
        for slot in self.slots:
            done, _ = self.ray.wait([slot.running], timeout=0)
            if not done:
                self._end_if_stalled(slot)
            elif slot.restarts.due(f"the worker actor of bundle {slot.bundle} {self._ended(slot)}"):
                self.ray.kill(slot.actor, no_restart=True)
                slot.actor = self._actor(slot)
                self._run(slot)

    def _end_if_stalled(self, slot: Slot) -> None:
        """Kill the actor whose worker stalled (the next look finds it dead and replaces it)."""
        now = time.monotonic()
        silent = 0.0
        if slot.ping is not None:
            answered, _ = self.ray.wait([slot.ping], timeout=0)
            if answered:
                was_ready = slot.ready
                silent, slot.ready = self.ray.get(slot.ping)
                slot.ping, slot.answered = None, now
                if slot.ready and not was_ready:
                    logger.info("the worker actor of bundle %d is ready: a stall now ends it after %g s "
                                "(--heartbeat-timeout)", slot.bundle, self.heartbeat_timeout)  # fmt: skip
            elif now - slot.asked > (self.heartbeat_timeout if slot.ready else self.join_timeout):
                silent = now - slot.answered  # the actor itself does not answer: stopped, or the GIL held
        if silent:
            logger.error(
                "the worker actor of bundle %d stalled: no liveness beat for %.1f s (stopped, or hung); killing it",
                slot.bundle,
                silent,
            )
            self.ray.kill(slot.actor, no_restart=True)
            slot.ping = None
        elif slot.ping is None and now - slot.answered >= PING_INTERVAL_S:
            slot.ping, slot.asked = slot.actor.ping.remote(), now

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
