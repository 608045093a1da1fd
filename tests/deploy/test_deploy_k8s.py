"""deploy/k8s: every overlay renders with `kubectl kustomize`, is valid against the Kubernetes schemas (1.27, the
first with native gRPC probes, and the newest that kubernetes-validate ships; CRDs — ServiceMonitor — are checked
only by the wiring below), and is wired together: the commands parse with the real parsers and the mounted
ConfigMap; Service ports, container ports and flags agree; probes hit the gRPC port; workers point at the
scheduler Service; secrets are mounted where the flags look; the topology names the worker pods."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import pytest
import yaml

from proto.parallel import ParallelLayout
from scheduler_node.api.health import LIVENESS
from scheduler_node.engine.placement import place
from scheduler_node.engine.topology import parse_topology
from settings.process import TOKEN_ENV
from tests.support.k8s import K8S, World, files_in, mounts, parse_command, pod_spec, render, resolve
from tests.support.paths import REPO

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
CRD_GROUPS = ("monitoring.coreos.com/",)  # no schema shipped by kubernetes-validate
PORT_FLAGS = {"grpc": "port", "workers": "worker_port", "metrics": "metrics_port", "http": "openai_port"}

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")]


def scheduler_of(world: World, tmp: Path) -> tuple[dict, dict, argparse.Namespace]:
    deployment = world.one("Deployment", "minivllm-scheduler")
    spec = pod_spec(deployment)
    container = spec["containers"][0]
    args = parse_command(container["command"] + container.get("args", []), spec, container, world, tmp)
    return spec, container, args


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, World]:
    return request.param, World(render(K8S / "overlays" / request.param))


@pytest.mark.parametrize("version", ["1.27.0", "latest"])
def test_every_overlay_is_valid_against_the_kubernetes_schemas(overlay: tuple[str, World], version: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    name, world = overlay
    checked = 0
    for doc in world.docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
        checked += 1
    assert checked >= 4, f"{name}: only {checked} resources were schema-checked"


def test_service_ports_probes_and_secrets_match_the_scheduler_flags(overlay: tuple[str, World], tmp_path: Path) -> None:
    name, world = overlay
    spec, container, args = scheduler_of(world, tmp_path)
    service = world.one("Service", "minivllm-scheduler")
    assert (
        service["spec"]["selector"].items() <= world.one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port_name, number in ports.items():
        assert number == getattr(args, PORT_FLAGS[port_name]), f"{name}: containerPort {port_name} != its flag"
    for p in service["spec"]["ports"]:
        assert p["targetPort"] in ports and p["port"] == ports[p["targetPort"]], f"{name}: Service port {p}"
    binds = {"grpc": args.host, "http": args.host, "metrics": args.metrics_host}
    exposed = {p["targetPort"] for p in service["spec"]["ports"]}
    for port_name in exposed & binds.keys():
        assert binds[port_name] in ("0.0.0.0", "::"), f"{name}: {port_name} is behind a Service but bound locally"
    if "workers" in exposed:  # the pod's IP (the Service's target), not every interface: issue 45
        env = {e["name"]: e for e in container.get("env", [])}
        assert args.worker_host == "$(POD_IP)", f"{name}: the workers' port binds {args.worker_host}"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    grace = spec["terminationGracePeriodSeconds"]
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container[kind]
        if "grpc" in probe:
            assert probe["grpc"]["port"] == args.port, f"{name}: {kind} port"
            assert probe["grpc"].get("service", "") == (LIVENESS if kind == "livenessProbe" else "")
            assert not args.tls_cert, f"{name}: native gRPC probes cannot speak TLS"
        else:
            client = parse_command(probe["exec"]["command"], spec, container, world, tmp_path)
            check_client(client, args, spec, container, world)
            assert client.health_service == (LIVENESS if kind == "livenessProbe" else "")
    drain = parse_command(container["lifecycle"]["preStop"]["exec"]["command"], spec, container, world, tmp_path)
    check_client(drain, args, spec, container, world)
    assert args.shutdown_timeout <= drain.timeout < grace, f"{name}: the preStop drain must fit the grace period"

    env = {e["name"]: e for e in container.get("env", [])}
    assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": "minivllm-control", "key": "token"}
    if args.tls_cert:
        for path in (args.tls_cert, args.tls_key):
            volume, _ = resolve(path, spec, container, world)
            assert volume["secret"]["secretName"] == "minivllm-tls"
    if args.zmq_curve_dir:
        need = {"scheduler.key_secret", "scheduler.key", "worker.key_secret", "authorized/worker.key"}
        check_curve(args.zmq_curve_dir, need, spec, container, world)


def check_client(client: argparse.Namespace, scheduler: argparse.Namespace, spec: dict, container: dict,
                 world: World) -> None:  # fmt: skip
    """A vllm-client in the scheduler's pod reaches its gRPC port, with TLS exactly when the scheduler has it."""
    assert client.host == "127.0.0.1" and client.port == scheduler.port
    assert bool(client.tls_ca) == bool(scheduler.tls_cert)
    if client.tls_ca:
        resolve(client.tls_ca, spec, container, world)


def check_curve(folder: str, need: set[str], spec: dict, container: dict, world: World) -> None:
    volume = mounts(spec, container).get(folder)
    assert volume is not None and volume["secret"]["secretName"] == "minivllm-curve", f"{folder} is not mounted"
    assert need <= files_in(volume, world), f"{folder} lacks {need - files_in(volume, world)}"


def test_workers_join_the_scheduler_service_with_stable_ranks(overlay: tuple[str, World], tmp_path: Path) -> None:
    name, world = overlay
    spec, container, args = scheduler_of(world, tmp_path)
    layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size)
    volume, topology_name = resolve(args.topology, spec, container, world)
    topology = parse_topology(yaml.safe_load(world.config_data(volume)[topology_name]), topology_name)
    placement = place(topology, layout)  # fits, or raises naming what does not
    statefulset = world.maybe("StatefulSet")
    if statefulset is None:  # one pod holds the world: vllm-serve and its local workers
        assert container["command"] == ["vllm-serve"] and args.worker_host == "127.0.0.1"
        assert all(g.host is None for g in topology.groups)
        check_devices(topology.device, container, layout.world_size)
        return
    wspec = pod_spec(statefulset)
    worker = wspec["containers"][0]
    per_pod = int(next(e["value"] for e in worker["env"] if e["name"] == "WORKERS_PER_POD"))
    replicas = statefulset["spec"]["replicas"]
    assert per_pod * replicas == layout.world_size, f"{name}: {replicas} pods x {per_pod} != TP x PP"
    headless = world.one("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    pod_hosts = [f"{statefulset['metadata']['name']}-{i}.{headless['metadata']['name']}" for i in range(replicas)]
    assert [g.host for g in topology.groups] == pod_hosts, f"{name}: the topology must name the worker pods"
    assert all(len(g.device_ids) == per_pod for g in topology.groups)
    assert {r.host for r in placement.ranks if r.tp_rank == 0} == set(pod_hosts)  # one stage per pod
    if replicas > 1:
        assert args.distributed_port, f"{name}: rank 0 is on another pod; the scheduler cannot pick its port"
    check_devices(topology.device, worker, per_pod)

    script = "\n".join(worker["command"] + worker["args"])
    commands = re.findall(r"^\s*(vllm-worker [^&\n]*)", script, re.M)
    assert commands and "WORKERS_PER_POD" in script, f"{name}: the worker pod does not start its workers"
    service = world.one("Service", "minivllm-scheduler")
    workers_port = next(p for p in service["spec"]["ports"] if p["name"] == "workers")
    for command in commands:
        wargs = parse_command(command.split(), wspec, worker, world, tmp_path)
        assert wargs.scheduler_address == f"minivllm-scheduler:{workers_port['port']}", name
        assert workers_port["port"] == args.worker_port
        assert bool(wargs.zmq_curve_dir) == bool(args.zmq_curve_dir), f"{name}: CURVE on one side only"
        if wargs.zmq_curve_dir:
            check_curve(wargs.zmq_curve_dir, {"worker.key_secret", "scheduler.key"}, wspec, worker, world)


def check_devices(device: str, container: dict, ranks: int) -> None:
    limits = container["resources"].get("limits", {})
    image = container["image"]
    if device == "cuda":
        assert int(limits.get("nvidia.com/gpu", 0)) == ranks and image.endswith(":cuda")
    else:
        assert "nvidia.com/gpu" not in limits and image.endswith(":cpu")
    assert (REPO / "deploy" / "docker" / f"Dockerfile.{image.rsplit(':', 1)[1]}").is_file(), image


def test_monitoring_disruption_and_autoscaling_point_at_real_objects(overlay: tuple[str, World]) -> None:
    name, world = overlay
    monitor = world.one("ServiceMonitor")
    service = world.one("Service", "minivllm-scheduler")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pods = [
        d["spec"]["template"]["metadata"]["labels"] for d in world.docs if d["kind"] in ("Deployment", "StatefulSet")
    ]
    selector = world.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert all(selector.items() <= labels.items() for labels in pods), f"{name}: the PDB misses pods"
    hpa = world.maybe("HorizontalPodAutoscaler")
    if hpa is not None:
        target = hpa["spec"]["scaleTargetRef"]
        workload = world.one(target["kind"], target["name"])
        assert world.maybe("StatefulSet") is None, f"{name}: scaling a scheduler whose workers live elsewhere"
        assert workload["spec"]["template"]["spec"]["containers"][0]["command"] == ["vllm-serve"]


def test_the_openai_component_adds_a_port_the_scheduler_knows(tmp_path: Path) -> None:
    world = World(render(K8S / "overlays" / "cpu", tmp=tmp_path, components=(K8S / "components" / "openai",)))
    container = pod_spec(world.one("Deployment"))["containers"][0]
    assert any(p["name"] == "http" for p in world.one("Service", "minivllm-scheduler")["spec"]["ports"])
    test_service_ports_probes_and_secrets_match_the_scheduler_flags(("cpu+openai", world), tmp_path)
    assert container["ports"]
