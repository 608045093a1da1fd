"""deploy/helm/minivllm: the Helm chart renders with Helm itself (tests/support/helm.py: Helm v4's Go SDK, from the
dev extra's helm-python-sdk) — the design article's values file as written (section 3.3; its model, qwen-7b, is our
default) and the defaults; `helm lint --strict` passes; every object is valid against the Kubernetes schemas like
the kustomize overlays; the same wiring checks as the overlays hold (tests/deploy/test_deploy_k8s.py: commands
parsed with their own parsers and the mounted ConfigMap, ports, probes, preStop, secrets, topology and GPUs); the
Ingress routes to the gRPC port (or port http); and bad values fail with Helm's message naming the value.
Without Helm the tests skip, except in CI (CI=true), where they fail."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_node.cli.serve import replica_plans
from settings.cli import from_args
from settings.lora import LoraConfig
from tests.deploy import test_deploy_k8s as k8s
from tests.seeds.blocks import block
from tests.support.helm import Helm, HelmError, find_helm
from tests.support.k8s import World, parse_command, pod_spec, resolve
from tests.support.paths import REPO

# The article's file (section 3.3), as written but for the model.
ARTICLE = yaml.safe_load(block("helm_values").text)
# Everything else on: a CPU world of TP 2 x PP 2, the HTTP API routed by the Ingress, the ServiceMonitor.
CPU_HTTP: dict[str, Any] = {
    "engine": {"args": ["--tensor-parallel-size", "2", "--pipeline-parallel-size=2"]},
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix", "port": "http"}]}],
        "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
    },
    "serviceMonitor": {"enabled": True},
}
VALUES = {"defaults": None, "article": ARTICLE, "cpu-http": CPU_HTTP}
CRD_GROUPS = ("monitoring.coreos.com/",)

pytestmark = pytest.mark.e2e  # as the kustomize tests: a helm binary, where there is one, runs as a process


@pytest.fixture(scope="module")
def helm() -> Helm:
    found = find_helm()
    if found is None:
        reason = "no Helm: helm-python-sdk is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(reason)  # CI installs the dev extra: a missing Helm is a broken set-up, not a skip
        pytest.skip(reason)
    return found


@pytest.fixture(scope="module", params=list(VALUES))
def rendered(request: pytest.FixtureRequest, helm: Helm) -> tuple[str, World]:
    return request.param, World(helm.template(VALUES[request.param]))


def engine_of(world: World, tmp: Path) -> tuple[dict, dict, argparse.Namespace]:
    deployment = world.one("Deployment", "minivllm-scheduler")
    spec = pod_spec(deployment)
    container = spec["containers"][0]
    return spec, container, parse_command(container["command"] + container["args"], spec, container, world, tmp)


@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_passes(helm: Helm, name: str) -> None:
    assert helm.lint(VALUES[name]) == [], helm.version


@pytest.mark.parametrize("version", ["1.27.0", "latest"])
def test_every_object_is_valid_against_the_kubernetes_schemas(rendered: tuple[str, World], version: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    name, world = rendered
    checked = [d for d in world.docs if not d["apiVersion"].startswith(CRD_GROUPS)]
    for doc in checked:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
    kinds = {d["kind"] for d in checked}
    assert {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"} <= kinds, f"{name}: {kinds}"


def test_the_overlays_wiring_checks_hold(rendered: tuple[str, World], tmp_path: Path) -> None:
    """The checks every kustomize overlay passes: ports and flags agree, gRPC probes, the preStop drain within the
    grace period, the token and CURVE secrets, the topology fits TP x PP and the pod's GPUs (one per worker)."""
    name, world = rendered
    k8s.test_service_ports_probes_and_secrets_match_the_scheduler_flags((name, world), tmp_path)
    k8s.test_workers_join_the_scheduler_service_with_stable_ranks((name, world), tmp_path)
    if world.maybe("ServiceMonitor") is not None:
        k8s.test_monitoring_disruption_and_autoscaling_point_at_real_objects((name, world))


def test_the_article_values_give_three_worlds_of_two_gpus(helm: Helm, tmp_path: Path) -> None:
    world = World(helm.template(ARTICLE))
    deployment = world.one("Deployment", "minivllm-scheduler")
    assert deployment["spec"]["replicas"] == 3
    spec, container, args = engine_of(world, tmp_path)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["image"] == "minivllm:cuda"
    assert container["args"][-3:] == ARTICLE["engine"]["args"], "engine.args go last: they win over the file"
    assert (args.model, args.tensor_parallel_size, args.pipeline_parallel_size) == ("default", 2, 1)
    assert args.max_lora_rank == 64 and from_args(LoraConfig, args).max_lora_rank == 64
    assert args.device == "cuda" and args.worker_host == "127.0.0.1"
    volume, name = resolve(args.topology, spec, container, world)
    local = tmp_path / name
    local.write_text(world.config_data(volume)[name])
    args.topology = str(local)
    (plan,) = replica_plans(args)  # what vllm-serve does first: place the 2 ranks on the pod's 2 GPUs
    assert [r.device for r in plan.placement.ranks] == ["cuda:0", "cuda:1"]


def test_the_article_ingress_speaks_grpc_to_the_grpc_port(helm: Helm, tmp_path: Path) -> None:
    world = World(helm.template(ARTICLE))
    ingress = world.one("Ingress")
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}
    _, _, args = engine_of(world, tmp_path)
    check_backends(world, ingress, "grpc", args.port)


def test_the_ingress_can_route_the_http_api(helm: Helm, tmp_path: Path) -> None:
    world = World(helm.template(CPU_HTTP))
    ingress = world.one("Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx" and ingress["spec"]["tls"] == CPU_HTTP["ingress"]["tls"]
    assert [r["host"] for r in ingress["spec"]["rules"]] == ["llm.example.com"]
    _, _, args = engine_of(world, tmp_path)
    check_backends(world, ingress, "http", args.openai_port)


def check_backends(world: World, ingress: dict, port_name: str, flag_port: int) -> None:
    """Every path of the Ingress reaches the scheduler Service's port `port_name`, which is the flag's port."""
    service = world.one("Service", "minivllm-scheduler")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    paths = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths
    for path in paths:
        backend = path["backend"]["service"]
        assert backend == {"name": "minivllm-scheduler", "port": {"name": port_name}}, path
    assert ports[port_name]["appProtocol"] == port_name
    container = pod_spec(world.one("Deployment"))["containers"][0]
    target = next(p for p in container["ports"] if p["name"] == ports[port_name]["targetPort"])
    assert target["containerPort"] == flag_port


def test_the_defaults_are_one_cpu_world_without_an_ingress(helm: Helm, tmp_path: Path) -> None:
    world = World(helm.template())
    assert world.one("Deployment")["spec"]["replicas"] == 1
    assert world.maybe("Ingress") is None and world.maybe("ServiceMonitor") is None
    _, container, args = engine_of(world, tmp_path)
    assert container["image"] == "minivllm:cpu" and args.device == "cpu"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_a_release_name_prefixes_every_object(helm: Helm) -> None:
    docs = helm.template(ARTICLE, release="prod")
    assert {d["metadata"]["name"] for d in docs} == {
        "prod-minivllm",
        "prod-minivllm-config",
        "prod-minivllm-scheduler",
    }
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "prod-minivllm-scheduler"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": {"replicaCount": 0}}, "/engine/replicaCount"),
        ({"engine": {"replicaCount": -1}}, "/engine/replicaCount"),
        ({"engine": {"replicaCount": "3"}}, "/engine/replicaCount"),
        ({"engine": {"args": ["--tensor-parallel-size=two"]}}, "--tensor-parallel-size must be a positive integer"),
        (
            {"engine": {"args": ["--tensor-parallel-size=2"], "resources": {"limits": {"nvidia.com/gpu": 4}}}},
            "engine.resources.limits nvidia.com/gpu is 4, but engine.args start --tensor-parallel-size 2 x "
            "--pipeline-parallel-size 1 = 2 workers",
        ),
        (
            {"ingress": {**ARTICLE["ingress"], "hosts": [{"host": "", "paths": [{"path": "/", "port": "http"}]}]}},
            "path / routes to port http, but ingress.annotations set nginx.ingress.kubernetes.io/backend-protocol",
        ),
        (
            {"openai": {"enabled": False}, "ingress": {"enabled": True, "hosts": [{"paths": [{"port": "http"}]}]}},
            "routes to port http, but openai.enabled is false",
        ),
        ({"ingress": {"enabled": True, "hosts": [{"paths": [{"path": "/", "port": "metrics"}]}]}}, "/port"),
    ],
)
def test_bad_values_fail_naming_the_value(helm: Helm, values: dict, message: str) -> None:
    with pytest.raises(HelmError) as failure:
        helm.template(values)
    assert message in str(failure.value), str(failure.value)


def test_the_operations_guide_shows_the_article_values() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text[text.index("**Helm**") :], re.S)
    assert block is not None and yaml.safe_load(block.group(1)) == ARTICLE
