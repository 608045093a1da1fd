"""deploy/k8s/router: the fleet kit (N one-pod replicas behind vllm-router, upgraded one pod at a time with live
migration) renders, is valid against the Kubernetes schemas, and is wired together: every command parses with its
real parser and the mounted ConfigMap; the router's replica list names the StatefulSet's pods by their stable DNS
names and ports, under the name the replicas serve; each replica's preStop is `vllm-client drain --migrate` against
its own gRPC port, within the grace period; the rolling update takes one pod at a time and waits long enough for the
router to take the new one back; the PodDisruptionBudgets and the ServiceMonitor cover what they should. The
preStop itself runs against a real fleet in tests/e2e/test_router.py."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import pytest

from router_node.probe import REOPEN_AFTER_S
from scheduler_node.api.health import LIVENESS
from scheduler_node.engine.model_path import served_name
from settings.process import TOKEN_ENV
from tests.support.k8s import FLEET, World, files_in, fleet_prestop, mounts, parse_command, pod_spec, render, resolve

PORT_FLAGS = {"grpc": "port", "http": "openai_port", "metrics": "metrics_port"}

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")]


@pytest.fixture(scope="module")
def fleet() -> World:
    return World(render(FLEET))


def command_of(world: World, kind: str, name: str, tmp: Path) -> tuple[dict, dict, argparse.Namespace]:
    spec = pod_spec(world.one(kind, name))
    container = spec["containers"][0]
    return spec, container, parse_command(container["command"] + container.get("args", []), spec, container, world, tmp)


@pytest.mark.parametrize("version", ["1.27.0", "latest"])
def test_the_fleet_is_valid_against_the_kubernetes_schemas(fleet: World, version: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    checked = [d for d in fleet.docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    for doc in checked:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
    assert len(checked) >= 7


@pytest.mark.parametrize("name", ["minivllm-router", "minivllm-replica"])
def test_ports_probes_and_the_token_match_the_flags(fleet: World, name: str, tmp_path: Path) -> None:
    kind = "Deployment" if name == "minivllm-router" else "StatefulSet"
    _, container, args = command_of(fleet, kind, name, tmp_path)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {port: getattr(args, flag) for port, flag in PORT_FLAGS.items()}, name
    assert args.host == args.metrics_host == "0.0.0.0", f"{name}: reached from other pods"
    service = fleet.one("Service", name)
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == ports, name
    for probe, health_service in (("readinessProbe", ""), ("livenessProbe", LIVENESS)):
        assert container[probe]["grpc"] == {"port": args.port, **({"service": LIVENESS} if health_service else {})}
    env = {e["name"]: e for e in container["env"]}
    assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": "minivllm-control", "key": "token"}
    for variable in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):  # Kubernetes expands $(NAME) in args
        assert variable in env, f"{name}: $({variable}) is not in the container's env"
    assert container["image"].endswith(":cpu") and "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_the_router_lists_every_replica_pod_by_its_stable_name(fleet: World, tmp_path: Path) -> None:
    _, _, router = command_of(fleet, "Deployment", "minivllm-router", tmp_path)
    _, _, replica = command_of(fleet, "StatefulSet", "minivllm-replica", tmp_path)
    statefulset = fleet.one("StatefulSet", "minivllm-replica")
    headless = fleet.one("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    pods = [f"minivllm-replica-{i}.{headless['metadata']['name']}" for i in range(statefulset["spec"]["replicas"])]
    assert [r.address for r in router.replica] == [f"{pod}:{replica.port}" for pod in pods]
    assert [r.http for r in router.replica] == [f"{pod}:{replica.openai_port}" for pod in pods]
    assert {r.model for r in router.replica} == {replica.served_model_name or served_name(replica.model)}
    assert router.replica_control_token == router.control_token  # both from the env: the replicas' token too


def test_each_replica_migrates_its_streams_away_before_it_stops(fleet: World, tmp_path: Path) -> None:
    spec, container, replica = command_of(fleet, "StatefulSet", "minivllm-replica", tmp_path)
    drain = parse_command(fleet_prestop(fleet), spec, container, fleet, tmp_path)
    assert drain.migrate and drain.host == "127.0.0.1" and drain.port == replica.port and not drain.tls_ca
    grace = spec["terminationGracePeriodSeconds"]
    assert replica.shutdown_timeout <= drain.timeout and drain.timeout + replica.shutdown_timeout < grace
    assert replica.worker_host == "127.0.0.1", "the workers live in the replica's pod"
    assert not replica.exit_after_drain, "vllm-serve would start the drained scheduler again in a stopping pod"
    assert container["args"][-1] == "--kv-transfer-host=$(POD_IP)", "other pods pull a migrated stream's KV here"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    volume = mounts(spec, container)[replica.zmq_curve_dir]
    need = {"scheduler.key", "scheduler.key_secret", "worker.key", "worker.key_secret", "authorized/worker.key"}
    assert volume["secret"]["secretName"] == "minivllm-curve" and need <= files_in(volume, fleet)
    resolve("/etc/minivllm/config/replica.yaml", spec, container, fleet)


def test_the_rolling_update_takes_one_pod_at_a_time_and_waits_for_the_router(fleet: World, tmp_path: Path) -> None:
    _, _, router = command_of(fleet, "Deployment", "minivllm-router", tmp_path)
    statefulset = fleet.one("StatefulSet", "minivllm-replica")["spec"]
    assert statefulset["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert statefulset["replicas"] >= 2, "a replica's streams need another replica to move to"
    # The router probes a replaced pod SERVING within a fresh channel's delay plus a probe; only then may the next
    # pod be drained (else its streams find no other replica and run on where they are).
    assert statefulset["minReadySeconds"] > REOPEN_AFTER_S + router.probe_interval + router.probe_timeout
    deployment = fleet.one("Deployment", "minivllm-router")["spec"]
    assert deployment["replicas"] >= 2 and deployment["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_disruption_budgets_and_monitoring_cover_the_router_and_the_replicas(fleet: World) -> None:
    workloads = {d["metadata"]["name"]: d for d in fleet.docs if d["kind"] in ("Deployment", "StatefulSet")}
    budgets = [d for d in fleet.docs if d["kind"] == "PodDisruptionBudget"]
    for name, workload in workloads.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        [budget] = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert budget["spec"]["maxUnavailable"] == 1, name  # one replica (or router) evicted at a time
    monitor = fleet.one("ServiceMonitor")
    for name in workloads:
        service = fleet.one("Service", name)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items(), name
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
