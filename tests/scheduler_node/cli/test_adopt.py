"""A scheduler without --model takes the model and the world's shape from the first worker that names them, and
every worker that names another model or shape is refused by name (scheduler_node/cli/adopt.py); the whole path,
processes and sockets: tests/e2e/test_multinode_lines.py."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from proto.parallel import ParallelLayout
from proto.wire import WorkerHello
from scheduler_node.cli.adopt import adopt_first_worker, adopted, same_model, world_vet
from scheduler_node.cli.scheduler import build_parser
from scheduler_node.engine.ports import free_port
from scheduler_node.engine.worker_link import WorkerLink

pytestmark = pytest.mark.unit


def hello(model: str = "", tp: int = 0, pp: int = 0) -> WorkerHello:
    return WorkerHello("node1", 7, "cpu", model, tp, pp)


def scheduler_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--host", "127.0.0.1", "--port", "50051", *argv])


def test_the_first_worker_names_the_model_and_the_shape() -> None:
    args = adopted(scheduler_args(), hello("/models/qwen-72b", 2, 2))
    assert (args.model, args.tensor_parallel_size, args.pipeline_parallel_size) == ("/models/qwen-72b", 2, 2)
    assert args.num_workers is None


def test_a_first_worker_that_names_nothing_leaves_the_default_model_and_the_schedulers_shape() -> None:
    args = adopted(scheduler_args("--tensor-parallel-size", "2"), hello())
    assert (args.model, args.tensor_parallel_size) == ("default", 2)


def test_a_worker_that_disagrees_is_refused_naming_each_difference(tmp_path: Path) -> None:
    vet = world_vet(str(tmp_path), ParallelLayout(2, 2))
    assert vet(hello(str(tmp_path), 2, 2)) == ""
    assert vet(hello()) == ""  # names nothing: serves what it is assigned
    why = vet(hello("/elsewhere/llama3", 2, 1))
    assert why == (
        f"this worker disagrees with the world: --model /elsewhere/llama3 (the world serves {tmp_path}); "
        "--pipeline-parallel-size 1 (the world's is 2)"
    )
    assert vet(hello(str(tmp_path), 0, 0)).endswith(
        "--tensor-parallel-size 1 (the world's is 2); --pipeline-parallel-size 1 (the world's is 2)"
    )  # a worker that names its model and not its shape says TP 1 x PP 1, as vLLM's defaults


def test_one_model_named_two_ways_is_the_same(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert same_model(str(tmp_path / "m"), str(tmp_path / "." / "m"))
    assert not same_model(str(tmp_path / "m"), str(tmp_path / "n"))
    assert same_model("org/name", "org/name")


def test_a_scheduler_no_worker_joins_gives_up_after_the_join_timeout() -> None:
    async def scenario() -> str:
        args = scheduler_args(
            "--port", str(free_port()), "--worker-host", "127.0.0.1", "--worker-port", str(free_port())
        )
        args.worker_join_timeout = 0.2
        link = WorkerLink(f"127.0.0.1:{args.worker_port}")
        with pytest.raises(TimeoutError) as caught:
            await adopt_first_worker(args, link)
        return str(caught.value)

    assert asyncio.run(scenario()).startswith("no worker joined 127.0.0.1:")
