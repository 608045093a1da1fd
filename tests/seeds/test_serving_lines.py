"""The vLLM article's launch lines run as written (tests/seeds/blocks.py): `vllm-serving` with TP 2 x PP 4 and
16-token blocks (section 1.2), `vllm-serving --config config.yaml --port 8000` (3.1), and the multi-node lines,
a scheduler with no model and TP 2 x PP 2 workers at its gRPC address (3.2); each world answers tokens.

Ports are free ones where the article writes fixed ones (a test machine may run another server), and every line
serves a tiny four-layer Llama in place of the default model: SmolLM2-135M's 9 attention heads do not split two
ways, which the last test shows is refused by name (TP 2 needs a model whose heads it divides, as in vLLM)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from minivllm.cluster import REPO, free_port, wait_serving
from minivllm.tiny_models import build_tiny_model
from proto import serving_pb2_grpc as pb_grpc
from proto.parallel import ParallelLayout
from tests.seeds.blocks import DEFAULT_MODEL, block
from tests.support.ops import greedy_ids, kill_with_children
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# What every process here adds to the article's line: one thread each and a small KV cache (CI has 2 cores).
SMALL = ["--threads", "1", "--kv-cache-memory", "16MiB", "--log-level", "WARNING"]
MODULES = {"vllm-serving": "scheduler_node.cli.serve", "vllm-scheduler": "scheduler_node.cli.scheduler"}
MODULES["vllm-worker"] = "worker_node.worker"


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-4"), smollm2_dir, num_hidden_layers=4)


def commands(text: str) -> list[list[str]]:
    """The shell lines of a block: continuations joined, comments and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """A command as its console script would run it (the installed scripts may point at another checkout)."""
    program = [sys.executable, "-m", MODULES[argv[0]], *argv[1:]]
    return subprocess.Popen(program, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def completion(http_port: int) -> dict:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_http(http_port: int, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout, f"vllm-serving on {http_port}")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        kill_with_children(proc)


def test_hybrid_parallel_serving_line(four_layers: Path, tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    (argv,) = commands(block("hybrid_parallel_serving").text)
    assert argv[:2] == ["vllm-serving", "--model"] and argv[argv.index("--block-size") + 1] == "16"
    argv[2] = str(four_layers)
    http_port = free_port()
    argv += ["--port", str(http_port), "--grpc-port", str(free_port()), *SMALL]
    log = tmp_path / "serve.log"
    procs.append(spawn(argv, log))
    wait_http(http_port, procs[0], log)
    assert completion(http_port)["usage"]["completion_tokens"] == 4
    stats = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in stats


def test_config_file_serves_http_on_its_port(four_layers: Path, tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    config = block("config_yaml").text.replace(f'model: "{DEFAULT_MODEL}"', f'model: "{four_layers}"')
    (tmp_path / "config.yaml").write_text(config + "\n")
    (argv,) = commands(block("serve_config").text)
    http_port = free_port()
    argv[argv.index("--port") + 1] = str(http_port)  # the article's 8000, free here
    argv = [argv[0], "--config", str(tmp_path / "config.yaml"), *argv[3:], "--grpc-port", str(free_port()), *SMALL]
    log = tmp_path / "serve.log"
    procs.append(spawn(argv, log))
    wait_http(http_port, procs[0], log)
    assert completion(http_port)["model"] == four_layers.name  # the served name: the folder's


def test_multi_node_lines(four_layers: Path, tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    import grpc

    scheduler, worker = commands(block("multi_node").text)
    port = free_port()
    scheduler[scheduler.index("--port") + 1] = str(port)  # the article's 50051, free here
    scheduler += ["--worker-port", str(free_port()), "--log-level", "WARNING"]
    worker[worker.index("--scheduler-address") + 1] = f"127.0.0.1:{port}"
    worker[worker.index("--model") + 1] = str(four_layers)
    worker += SMALL
    layout = ParallelLayout(
        tensor_parallel_size=int(worker[worker.index("--tensor-parallel-size") + 1]),
        pipeline_parallel_size=int(worker[worker.index("--pipeline-parallel-size") + 1]),
    )
    logs = [tmp_path / f"{name}.log" for name in ("scheduler", *(f"worker{r}" for r in range(layout.world_size)))]
    procs.append(spawn(scheduler, logs[0]))
    procs += [spawn(worker, log) for log in logs[1:]]  # one per node: 2 x 2 ranks
    text = lambda: "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs if p.exists())  # noqa: E731
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        wait_serving(channel, procs, 240.0, text)
        responses = list(pb_grpc.GenerationStub(channel).Generate(greedy_ids([1, 2, 3, 4], 4), timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4, text()


def test_the_default_model_cannot_split_two_ways_and_says_why() -> None:
    """SmolLM2-135M: 9 attention heads, 3 KV heads, 30 layers."""
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 must divide the model's 9 attention heads"):
        ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=4).check_model(9, 3, 1536, 30)
