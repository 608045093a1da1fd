"""Helpers of the operations tests (control, faults, metrics, security): streams in threads, extra workers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minivllm.cluster import Cluster
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.waiting import wait_for

VOCAB = 49152  # the tiny models share SmolLM2's tokenizer
TINY_WORKER = ["--kv-cache-memory", "16MiB"]


def prompt_ids(seed: int, n: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy_ids(ids: list[int], max_tokens: int, request_id: str = "", **kw: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling=sampling,
        **kw,  # type: ignore[arg-type]
    )


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    code: grpc.StatusCode | None = None  # set when the stream ended with an error
    details: str = ""
    ended_at: float = 0.0
    sequences: dict[int, list[int]] = field(default_factory=dict)  # n > 1: each sequence's tokens
    completion_tokens: int = 0  # usage, summed over the sequences


class Streams:
    """Each request streamed on its own thread; results collected as they arrive."""

    def __init__(self, stub: pb_grpc.GenerationStub, requests: list[pb.GenerateRequest], timeout: float = 120) -> None:
        self.results = [StreamResult() for _ in requests]
        self.threads = [
            threading.Thread(target=self._run, args=(stub, r, self.results[i], timeout), daemon=True)
            for i, r in enumerate(requests)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _run(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, out: StreamResult, timeout: float) -> None:
        try:
            for delta in stub.Generate(request, timeout=timeout):
                out.tokens.extend(delta.token_ids)
                out.sequences.setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason:
                    out.finish_reason = delta.finish_reason
                    out.completion_tokens += delta.usage.completion_tokens
        except grpc.RpcError as exc:
            out.code, out.details = exc.code(), exc.details() or ""
        out.ended_at = time.monotonic()

    def wait_all_started(self, timeout: float = 60) -> None:
        wait_for(lambda: all(r.tokens for r in self.results), timeout, "every stream has a first token")

    def join(self, timeout: float = 120) -> list[StreamResult]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"
        return self.results


def health_status(channel: grpc.Channel) -> int:
    try:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status)
    except grpc.RpcError:
        return -1


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_idle(control: pb_grpc.ControlStub, timeout: float = 20.0, metadata: tuple = ()) -> pb.Stats:
    deadline = time.monotonic() + timeout
    while True:
        stats = control.GetStats(pb.GetStatsRequest(), timeout=5, metadata=metadata)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.free_blocks == stats.total_blocks
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def add_worker(cluster: Cluster, name: str, worker_args: list[str]) -> None:
    """Start one more worker for the cluster's scheduler (a replacement), with the same flags as the first."""
    argv = [sys.executable, "-m", "worker_node.worker", "--scheduler-address", f"127.0.0.1:{cluster.worker_port}",
            "--threads", "1", "--log-level", "INFO", *worker_args]  # fmt: skip
    cluster.workers.append(cluster._spawn(name, argv))


def list_workers(cluster: Cluster, metadata: tuple = ()) -> list[pb.WorkerStatus]:
    control = pb_grpc.ControlStub(cluster.channel)
    return list(control.ListWorkers(pb.ListWorkersRequest(), timeout=5, metadata=metadata).workers)


def rank0(cluster: Cluster, metadata: tuple = ()) -> pb.WorkerStatus:
    return next(w for w in list_workers(cluster, metadata) if w.rank == 0 and w.state != "joining")


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def kill_with_children(serve: subprocess.Popen) -> None:
    """After a failure: vllm-serve's children run in sessions of their own, so killing it alone would leave them."""
    if serve.poll() is None:
        for pid in child_pids(serve.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        serve.kill()
        serve.wait()


def alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


@dataclass
class OpenAIResult:
    """One OpenAI stream as its client saw it: each choice's text and finish reasons, the response ids, usage."""

    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    chunks: int = 0
    usage: Any = None
    error: str = ""


class OpenAIStreams:
    """Each (client, kind, arguments) streamed on its own thread with the official `openai` client; kind is
    "chat", "completion" or "whole" (a completion, not streamed)."""

    def __init__(self, calls: list[tuple[Any, str, dict[str, Any]]]) -> None:
        self.results = [OpenAIResult() for _ in calls]
        self.threads = [
            threading.Thread(target=self._run, args=(*call, self.results[i]), daemon=True)
            for i, call in enumerate(calls)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _run(client: Any, kind: str, arguments: dict[str, Any], out: OpenAIResult) -> None:
        api = client.chat.completions if kind == "chat" else client.completions
        try:
            if kind == "whole":  # an unstreamed completion
                answer = api.create(**arguments)
                out.ids.add(answer.id)
                out.usage = answer.usage
                for choice in answer.choices:
                    out.texts[choice.index] = choice.text
                    out.finishes[choice.index] = [choice.finish_reason]
                return
            for chunk in api.create(**arguments, stream=True, stream_options={"include_usage": True}):
                out.ids.add(chunk.id)
                out.chunks += 1
                out.usage = chunk.usage or out.usage
                for choice in chunk.choices:
                    text = choice.delta.content if kind == "chat" else choice.text
                    out.texts[choice.index] = out.texts.get(choice.index, "") + (text or "")
                    if choice.finish_reason:
                        out.finishes.setdefault(choice.index, []).append(choice.finish_reason)
        except Exception as exc:  # the test reports it
            out.error = f"{type(exc).__name__}: {exc}"

    def join(self, timeout: float = 120) -> list[OpenAIResult]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"
        return self.results
