"""vllm-serve --data-parallel-size: replicas on disjoint devices (each TP group inside an island), each scheduler
given a topology of only its own devices, GPU slices without a topology, and the placement printout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proto.parallel import ParallelLayout
from scheduler_node.engine.data_parallel import place_replicas, plan_replicas
from scheduler_node.engine.placement import Placement
from scheduler_node.engine.topology import TopologyError, load_topology
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e

TOPOLOGIES = REPO / "deploy" / "topology"


def devices(placement: Placement) -> list[str]:
    """host/device of each rank (CPU "devices" are shard slots, told apart by their id)."""
    return [f"{r.host or ''}/{r.device if r.device != 'cpu' else r.slot.device_id}" for r in placement.ranks]


def test_replicas_that_fill_an_island_each_get_their_own() -> None:
    a, b = place_replicas(load_topology(TOPOLOGIES / "8gpu-2x4-nvlink.yaml"), ParallelLayout(4), 2)
    assert devices(a) == ["/cuda:0", "/cuda:1", "/cuda:2", "/cuda:3"]
    assert devices(b) == ["/cuda:4", "/cuda:5", "/cuda:6", "/cuda:7"]
    assert a.tp_links == b.tp_links == ["nvlink"]


def test_replicas_never_share_a_device_and_keep_tp_inside_an_island() -> None:
    for path, layout, count in [
        ("8gpu-2x4-nvlink.yaml", ParallelLayout(2), 4),
        ("2hosts-4gpu.yaml", ParallelLayout(2, 2), 2),
        ("2hosts-4gpu.yaml", ParallelLayout(4), 2),
        ("cpu.yaml", ParallelLayout(1), 4),
    ]:
        placements = place_replicas(load_topology(TOPOLOGIES / path), layout, count)
        used = [d for p in placements for d in devices(p)]
        assert len(used) == len(set(used)) == layout.world_size * count, (path, used)
        assert all(link != "network" for p in placements for link in p.tp_links), path


def test_replicas_that_do_not_fit_are_named() -> None:
    with pytest.raises(TopologyError, match="data-parallel replica 3 of 3: no device of .* is left"):
        place_replicas(load_topology(TOPOLOGIES / "8gpu-2x4-nvlink.yaml"), ParallelLayout(4), 3)
    with pytest.raises(TopologyError, match="data-parallel replica 2 of 2: TP 2 x PP 3 needs 6 devices; .* has 2"):
        place_replicas(load_topology(TOPOLOGIES / "8gpu-2x4-nvlink.yaml"), ParallelLayout(2, 3), 2)


def test_each_scheduler_gets_a_topology_of_its_own_devices() -> None:
    plans = plan_replicas(2, ParallelLayout(4), 50061, load_topology(TOPOLOGIES / "2hosts-4gpu.yaml"), False, True)
    assert [p.worker_port for p in plans] == [50061, 50062] and plans[0].port != plans[1].port
    for plan, host in zip(plans, ["node-a", "node-b"]):
        assert plan.topology_file is not None
        own = load_topology(plan.topology_file)
        assert [(g.host, g.device_ids) for g in own.groups] == [(host, (0, 1, 2, 3))]
        assert plan.worker_env == {}


def test_without_a_topology_each_replica_sees_its_slice_of_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plans = plan_replicas(3, ParallelLayout(2), 50061, None, False, True)
    assert [p.worker_env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3", "4,5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    plans = plan_replicas(2, ParallelLayout(2), 50061, None, False, True)
    assert [p.worker_env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="replica 3 needs GPUs 4..5 of CUDA_VISIBLE_DEVICES=4,5,6,7"):
        plan_replicas(3, ParallelLayout(2), 50061, None, False, True)
    assert all(p.worker_env == {} for p in plan_replicas(3, ParallelLayout(2), 50061, None, False, False))  # CPU


def test_without_a_worker_port_each_replica_joins_at_a_free_port_of_its_own() -> None:
    """vllm-serve's default (0): a fixed base made two vllm-serves on one host share their replicas' ports."""
    ports = [p.worker_port for p in plan_replicas(3, ParallelLayout(1), 0, None, False, False)]
    assert len(set(ports)) == 3 and all(port > 1024 for port in ports), ports
    twin = [p.worker_port for p in plan_replicas(3, ParallelLayout(1), 0, None, False, False)]
    assert not set(ports) & set(twin), (ports, twin)


def test_serve_prints_each_replicas_placement() -> None:
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--data-parallel-size", "2", "--tensor-parallel-size",
            "4", "--topology", str(TOPOLOGIES / "8gpu-2x4-nvlink.yaml"), "--print-placement"]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("stage 0: tensor parallel over nvlink") == 2
    assert "replica 1 at 127.0.0.1:" in out.stdout and "cuda:7" in out.stdout
    bad = subprocess.run([*argv[:-1], "--data-parallel-size", "3"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "data-parallel replica 3 of 3" in bad.stderr
