"""vllm-serve --data-parallel-size: replicas on disjoint devices (each TP group inside an island), each scheduler
given a topology of only its own devices, GPU slices without a topology, and the placement printout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proto.parallel import ParallelLayout
from scheduler_node.engine.data_parallel import place_replicas, place_round_robin, plan_replicas
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


def test_round_robin_puts_each_replica_inside_one_island_the_islands_in_turn() -> None:
    from tests.scheduler_node.engine.test_topology import ARTICLE_TEMPLATE

    topology = load_topology(ARTICLE_TEMPLATE)
    placements = place_round_robin(topology, ParallelLayout(2), 4)
    islands = [{r.slot.device_id // 4 for r in p.ranks} for p in placements]
    assert islands == [{0}, {1}, {0}, {1}]  # never straddling; replica i on island i mod 2
    assert [[r.slot.device_id for r in p.ranks] for p in placements] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [p.tp_links for p in placements] == [["nvlink"], ["pcie"], ["nvlink"], ["pcie"]]
    first_fit = place_replicas(topology, ParallelLayout(2), 2)  # pack: both on the first island
    assert [{r.slot.device_id // 4 for r in p.ranks} for p in first_fit] == [{0}, {0}]
    pipeline = place_round_robin(topology, ParallelLayout(2, 2), 2)  # TP x PP whole inside an island too
    assert [{r.slot.device_id // 4 for r in p.ranks} for p in pipeline] == [{0}, {1}]
    with pytest.raises(TopologyError, match=r"gpu_topology: cross_device round_robin .* island 0 \[0, 1, 2, 3\]"):
        place_round_robin(topology, ParallelLayout(4, 2), 1)
    with pytest.raises(TopologyError, match=r"replica 5 of 5: no island of gpu_topology has 2 devices left"):
        place_round_robin(topology, ParallelLayout(2), 5)


def test_vllm_serve_spreads_replicas_and_routes_them_in_turn(tmp_path: Path) -> None:
    from scheduler_node.cli.serve import build_parser, replica_plans, router_argv
    from settings.config_file import parse_args
    from settings.router import parse_replica

    config = tmp_path / "serve.yaml"
    config.write_text(
        "device: cpu\ndata_parallel_size: 2\ntensor_parallel_size: 2\n"
        "gpu_topology: [{device_ids: [0, 1, 2, 3], interconnect: nvlink},\n"
        "               {device_ids: [4, 5, 6, 7], interconnect: pcie}]\n"
        "scheduling_policy: {cross_device: round_robin, memory_sharing: enabled}\n"
    )
    args = parse_args(build_parser(), ["--config", str(config)])
    plans = replica_plans(args)
    assert [[r.slot.device_id for r in p.placement.ranks] for p in plans] == [[0, 1], [4, 5]]
    assert [load_topology(p.topology_file).groups[0].interconnect for p in plans if p.topology_file] == [
        "nvlink",
        "pcie",
    ]
    router = router_argv(args, plans)
    assert router[router.index("--routing-strategy") + 1] == "round_robin" and "--memory-sharing" in router
    specs = [parse_replica(v) for k, v in zip(router, router[1:]) if k == "--replica"]
    assert all(s.kv_events and s.kv_snapshot for s in specs)  # the router learns who holds which prefix
    one = parse_args(build_parser(), ["--config", str(config), "--data-parallel-size", "1"])
    with pytest.raises(ValueError, match=r"memory_sharing \(--memory-sharing\) .* needs --data-parallel-size >= 2"):
        replica_plans(one)
