"""The world's flags (vllm-scheduler, vllm-serve): how many workers split the model and how, where each rank goes,
and how long the rendezvous and the workers' join may take."""

from __future__ import annotations

import argparse

from proto.parallel import ParallelLayout
from proto.wire import WORKER_JOIN_TIMEOUT_S
from scheduler_node.engine.builder import EngineConfig
from scheduler_node.engine.placement import Placement, place
from scheduler_node.engine.topology import load_topology, single_island

_DEFAULTS = EngineConfig()


def add_world_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="workers that split every layer (heads, MLP, vocab) and all-reduce after each",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages, each holding a contiguous slice of the layers; the world is TP x PP workers",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="workers to wait for; derived from TP x PP, kept as a checked alias (it must equal TP x PP)",
    )
    p.add_argument(
        "--topology",
        default=None,
        metavar="FILE.yaml",
        help="devices, hosts and interconnects (deploy/topology/*.yaml) to place ranks on; default: one "
        "island, ranks in join order, each worker picks its device",
    )
    p.add_argument(
        "--allow-cross-island",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let a tensor-parallel group span slower links when it fits no fast island (else: fail at start)",
    )
    p.add_argument(
        "--print-placement",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print which rank goes on which host and device, and how the stages are linked, then exit",
    )
    p.add_argument(
        "--distributed-port",
        type=int,
        default=0,
        help="port of the torch.distributed rendezvous that rank 0 opens (0: one free on this host; set it "
        "when rank 0 runs on another host)",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=_DEFAULTS.distributed_timeout,
        help="seconds the rendezvous or any collective may wait for a peer rank before failing",
    )
    p.add_argument(
        "--worker-join-timeout",
        type=float,
        default=WORKER_JOIN_TIMEOUT_S,
        help="seconds to wait for all workers (a worker still loading after this long gives its rank back)",
    )


def resolve_parallel(args: argparse.Namespace) -> Placement:
    """The layout and where each rank goes; ValueError (naming what does not fit) when it cannot work."""
    layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size)
    if args.num_workers is not None and args.num_workers != layout.world_size:
        raise ValueError(
            f"--num-workers {args.num_workers} != --tensor-parallel-size {layout.tensor_parallel_size} x "
            f"--pipeline-parallel-size {layout.pipeline_parallel_size}; drop --num-workers (it is derived)"
        )
    if args.topology:
        return place(load_topology(args.topology), layout, args.allow_cross_island)
    return place(single_island(layout.world_size), layout, worker_chooses_device=True)
