"""Rendered Kubernetes manifests for tests: `kubectl kustomize` a kit, find its objects, and parse a container's
command line with the command's own parser (its --config read from the mounted ConfigMap)."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from settings.config_file import parse_args
from tests.support.paths import REPO

K8S = REPO / "deploy" / "k8s"
COMMANDS = {"vllm-scheduler": "scheduler_node.cli.scheduler", "vllm-serve": "scheduler_node.cli.serve",
            "vllm-worker": "worker_node.worker", "vllm-client": "clients.client",
            "vllm-router": "router_node.main"}  # fmt: skip


def render(*kustomizations: Path, tmp: Path | None = None, components: tuple[Path, ...] = ()) -> list[dict]:
    target = kustomizations[0]
    if components:  # an overlay plus components: a kustomization of our own around them
        assert tmp is not None
        relative = [os.path.relpath(k, tmp) for k in kustomizations]  # kustomize refuses absolute roots
        text = {"resources": relative, "components": [os.path.relpath(c, tmp) for c in components]}
        (tmp / "kustomization.yaml").write_text(yaml.safe_dump(text))
        target = tmp
    out = subprocess.run(["kubectl", "kustomize", str(target)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@dataclass
class World:
    docs: list[dict]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def maybe(self, kind: str) -> dict | None:
        found = [d for d in self.docs if d["kind"] == kind]
        return found[0] if found else None

    def config_data(self, volume: dict) -> dict[str, str]:
        name = volume["configMap"]["name"]
        return self.one("ConfigMap", name)["data"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def mounts(spec: dict, container: dict) -> dict[str, dict]:
    """mount path -> its volume."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def files_in(volume: dict, world: World) -> set[str]:
    """The file names a volume shows (ConfigMap keys, or a Secret's items' paths)."""
    if "configMap" in volume:
        return set(world.config_data(volume))
    items = volume["secret"].get("items")
    return {i["path"] for i in items} if items else {"tls.crt", "tls.key", "ca.crt"}  # a kubernetes.io/tls secret


def resolve(path: str, spec: dict, container: dict, world: World) -> tuple[dict, str]:
    """The volume a file path lies in and the file's name inside it; fails when nothing mounted holds it."""
    for mount_path, volume in mounts(spec, container).items():
        if path.startswith(mount_path.rstrip("/") + "/"):
            name = path[len(mount_path.rstrip("/")) + 1 :]
            assert name in files_in(volume, world), f"{path}: {name} is not in volume {volume['name']}"
            return volume, name
    raise AssertionError(f"{path} is not on any volume of container {container['name']}")


def parse_command(argv: list[str], spec: dict, container: dict, world: World, tmp: Path) -> argparse.Namespace:
    """Parse a container's command line with the command's own parser, --config read from its ConfigMap."""
    command, *rest = argv
    argv = list(rest)
    if "--config" in argv:
        i = argv.index("--config") + 1
        volume, name = resolve(argv[i], spec, container, world)
        local = tmp / f"{command}-{name}"
        local.write_text(world.config_data(volume)[name])
        argv[i] = str(local)
    return parse_args(importlib.import_module(COMMANDS[command]).build_parser(), argv)


FLEET = K8S / "router"  # N one-pod replicas behind vllm-router (rolling upgrades by live migration)


def fleet_prestop(world: World) -> list[str]:
    """The command each replica pod of the fleet kit runs before it is stopped (its preStop hook)."""
    container = pod_spec(world.one("StatefulSet", "minivllm-replica"))["containers"][0]
    return list(container["lifecycle"]["preStop"]["exec"]["command"])
