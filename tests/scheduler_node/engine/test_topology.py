"""Topology files, placement (TP inside a fast island, PP across slower links), rank claiming, the rank layout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proto.parallel import ParallelLayout, kv_head_range, vocab_shard
from proto.wire import WorkerHello
from scheduler_node.engine.placement import RankAssigner, place
from scheduler_node.engine.topology import TopologyError, load_topology, parse_topology, single_island
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e

TOPOLOGIES = REPO / "deploy" / "topology"


def layout(tp: int, pp: int = 1) -> ParallelLayout:
    return ParallelLayout(tp, pp)


def stage_devices(placement) -> list[list[str]]:  # type: ignore[no-untyped-def]
    stages: list[list[str]] = [[] for _ in range(placement.layout.pipeline_parallel_size)]
    for r in placement.ranks:
        stages[r.stage].append(f"{r.host or ''}/{r.device}")
    return stages


def test_every_example_file_loads() -> None:
    names = sorted(p.name for p in TOPOLOGIES.glob("*.yaml"))
    assert names == ["2hosts-4gpu.yaml", "8gpu-2x4-nvlink.yaml", "8gpu-pcie.yaml", "cpu.yaml"]
    for path in TOPOLOGIES.glob("*.yaml"):
        assert load_topology(path).num_devices in (4, 8)


def test_two_nvlink_islands_one_stage_each() -> None:
    p = place(load_topology(TOPOLOGIES / "8gpu-2x4-nvlink.yaml"), layout(4, 2))
    assert stage_devices(p) == [
        ["/cuda:0", "/cuda:1", "/cuda:2", "/cuda:3"],
        ["/cuda:4", "/cuda:5", "/cuda:6", "/cuda:7"],
    ]
    assert p.tp_links == ["nvlink", "nvlink"] and p.pp_links == ["pcie"]
    assert not p.cross_island


def test_small_tp_groups_stay_on_nvlink() -> None:
    p = place(load_topology(TOPOLOGIES / "8gpu-2x4-nvlink.yaml"), layout(2, 4))
    assert p.tp_links == ["nvlink"] * 4
    assert p.pp_links == ["nvlink", "pcie", "nvlink"]  # stages 0-1 on island 0, 2-3 on island 1


def test_tp_wider_than_an_island_fails_with_a_clear_message() -> None:
    topo = load_topology(TOPOLOGIES / "8gpu-2x4-nvlink.yaml")
    with pytest.raises(TopologyError) as err:
        place(topo, layout(8))
    text = str(err.value)
    assert "needs 8 devices inside one fast island" in text
    assert "--tensor-parallel-size <= 4" in text and "--allow-cross-island" in text
    p = place(topo, layout(8), allow_cross_island=True)
    assert p.cross_island and p.tp_links == ["pcie"]
    assert "spans islands" in p.describe()


def test_pcie_box_takes_tp8() -> None:
    p = place(load_topology(TOPOLOGIES / "8gpu-pcie.yaml"), layout(8))
    assert p.tp_links == ["pcie"] and [r.device for r in p.ranks] == [f"cuda:{i}" for i in range(8)]


def test_two_hosts_tp_inside_a_host_pp_over_the_network() -> None:
    topo = load_topology(TOPOLOGIES / "2hosts-4gpu.yaml")
    p = place(topo, layout(4, 2))
    assert stage_devices(p) == [
        ["node-a/cuda:0", "node-a/cuda:1", "node-a/cuda:2", "node-a/cuda:3"],
        ["node-b/cuda:0", "node-b/cuda:1", "node-b/cuda:2", "node-b/cuda:3"],
    ]
    assert p.tp_links == ["nvlink", "nvlink"] and p.pp_links == ["network"]
    with pytest.raises(TopologyError, match="none is left"):
        place(topo, layout(8))
    assert place(topo, layout(8), allow_cross_island=True).tp_links == ["network"]


def test_cpu_topology() -> None:
    p = place(load_topology(TOPOLOGIES / "cpu.yaml"), layout(2, 2))
    assert [r.device for r in p.ranks] == ["cpu"] * 4 and p.tp_links == ["loopback"] * 2


def test_too_many_ranks() -> None:
    with pytest.raises(TopologyError, match="needs 16 devices; .* has 8"):
        place(load_topology(TOPOLOGIES / "8gpu-pcie.yaml"), layout(4, 4))


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"groups": [{"interconnect": "infiniband", "device_ids": [0]}]}, "not one of nvlink, pcie"),
        ({"groups": [{"interconnect": "pcie", "device_ids": [0, 0]}]}, "listed twice"),
        ({"groups": [{"interconnect": "pcie", "device_ids": [0]}], "gpus": 2}, "unknown keys"),
        ({"groups": [{"device_ids": [0]}]}, "interconnect is missing"),
        ({"groups": [{"interconnect": "pcie", "device_ids": "0-3"}]}, "list of integers"),
        ({"device": "tpu", "groups": [{"interconnect": "pcie", "device_ids": [0]}]}, "device must be one of"),
        ({"groups": []}, "no groups"),
    ],
)
def test_bad_files_are_rejected(data: dict, error: str) -> None:
    with pytest.raises(TopologyError, match=error):
        parse_topology(data, "bad.yaml")


def test_workers_claim_the_ranks_of_their_host() -> None:
    p = place(load_topology(TOPOLOGIES / "2hosts-4gpu.yaml"), layout(4, 2))
    assigner = RankAssigner(p)
    free = list(range(8))

    def join(host: str, address: str) -> int | None:
        rank = assigner.claim(WorkerHello(host, 1, "cuda"), address, free)
        if rank is not None:
            free.remove(rank)
        return rank

    assert join("node-b", "10.0.0.2") == 4  # node-b joins first: it still gets stage 1
    assert join("other", "10.0.0.1") is None  # a host the topology does not name
    assert [join("node-a", "10.0.0.1") for _ in range(4)] == [0, 1, 2, 3]
    assert assigner.devices[4] == "cuda:0" and assigner.rendezvous_host == "node-a"
    assert join("node-a", "10.0.0.1") is None  # node-a is full


def test_a_dns_name_in_the_topology_matches_the_pod_whose_hostname_is_its_first_label() -> None:
    """deploy/k8s: StatefulSet pods report `minivllm-worker-1`, reached as `minivllm-worker-1.minivllm-worker`."""
    groups = [
        {"host": f"minivllm-worker-{i}.minivllm-worker", "interconnect": "nvlink", "device_ids": [0, 1]} for i in (0, 1)
    ]
    assigner = RankAssigner(place(parse_topology({"device": "cuda", "groups": groups}), layout(2, 2)))
    free = [0, 1, 2, 3]
    assert assigner.claim(WorkerHello("minivllm-worker-1", 1, "cuda"), "10.1.0.7", free) == 2
    assert assigner.claim(WorkerHello("minivllm-worker", 1, "cuda"), "10.1.0.9", free) is None  # not a prefix match
    assert assigner.claim(WorkerHello("minivllm-worker-0", 1, "cuda"), "10.1.0.8", free) == 0
    assert assigner.rendezvous_host == "minivllm-worker-0.minivllm-worker"


def test_without_a_topology_gpus_are_numbered_per_host() -> None:
    assigner = RankAssigner(place(single_island(4), layout(2, 2), worker_chooses_device=True))
    free = [0, 1, 2, 3]
    for host in ("a", "b", "a", "b"):
        free.remove(assigner.claim(WorkerHello(host, 1, "cuda"), host, free))  # type: ignore[arg-type]
    assert assigner.devices == {0: "cuda:0", 1: "cuda:0", 2: "cuda:1", 3: "cuda:1"}
    assert assigner.rendezvous_host == "a"  # rank 0 joined first, from "a"
    cpu = RankAssigner(place(single_island(1), layout(1), worker_chooses_device=True))
    assert cpu.claim(WorkerHello("h", 1, "cpu"), "127.0.0.1", [0]) == 0 and cpu.devices[0] == ""


def test_layout() -> None:
    lay = ParallelLayout(2, 3)
    assert lay.world_size == 6 and lay.output_rank == 4
    assert [lay.stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [lay.layer_range(s, 7) for s in range(3)] == [(0, 2), (2, 4), (4, 7)]
    assert [kv_head_range(2, 4, t) for t in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    assert [kv_head_range(4, 2, t) for t in range(2)] == [(0, 2), (2, 4)]  # split
    assert vocab_shard(10, 4, 3) == (9, 12)  # the last rank's rows run past the vocab: padding
    with pytest.raises(ValueError, match="must divide the model's 6 attention heads"):
        ParallelLayout(4).check_model(6, 6, 128, 2)
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        ParallelLayout(4).check_model(12, 3, 128, 2)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        ParallelLayout(1, 3).check_model(4, 2, 128, 2)


def _scheduler(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_node.cli.scheduler", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_print_placement_and_its_failures() -> None:
    topo = str(TOPOLOGIES / "2hosts-4gpu.yaml")
    ok = _scheduler(
        "--topology", topo, "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2", "--print-placement"
    )
    assert ok.returncode == 0, ok.stderr
    assert "stage 0 -> 1: pipeline over network" in ok.stdout and "node-b" in ok.stdout
    bad = _scheduler("--topology", topo, "--tensor-parallel-size", "8", "--print-placement")
    assert bad.returncode == 2 and "--allow-cross-island" in bad.stderr
    alias = _scheduler("--tensor-parallel-size", "2", "--num-workers", "3", "--print-placement")
    assert alias.returncode == 2 and "--num-workers 3 != --tensor-parallel-size 2" in alias.stderr


def test_serve_prints_the_placement_of_its_world() -> None:
    argv = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--print-placement"]
    out = subprocess.run(
        [sys.executable, "-m", "scheduler_node.cli.serve", *argv], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "TP 2 x PP 2 = 4 rank(s)" in out.stdout and "output rank 2" in out.stdout


ARTICLE_TEMPLATE = (
    '{"device": "cpu", "groups": [{"device_ids": [0, 1, 2, 3], "interconnect": "nvlink"}, '
    '{"device_ids": [4, 5, 6, 7], "interconnect": "pcie"}]}'
)  # the scheduler article's gpu_topology as a config file hands it on (settings/topology.py), CPU ranks as devices


def test_an_inline_topology_is_the_articles_gpu_topology() -> None:
    topology = load_topology(ARTICLE_TEMPLATE)
    assert topology.source == "gpu_topology"
    assert [(g.interconnect, g.device_ids) for g in topology.groups] == [
        ("nvlink", (0, 1, 2, 3)),
        ("pcie", (4, 5, 6, 7)),
    ]
    placement = place(topology, ParallelLayout(4))
    assert [r.slot.device_id for r in placement.ranks] == [0, 1, 2, 3] and placement.tp_links == ["nvlink"]
    with pytest.raises(TopologyError, match=r"none is left in gpu_topology"):
        place(topology, ParallelLayout(8))  # TP 8 would straddle the islands
    with pytest.raises(TopologyError, match=r"gpu_topology\[1\]: interconnect is missing"):
        load_topology('{"groups": [{"device_ids": [0], "interconnect": "pcie"}, {"device_ids": [1]}]}')
