"""The gRPC client of tests/e2e/test_netns.py, run inside the client's network namespace (`ip netns exec`): the
test process itself stays in the root namespace, which the network tests leave untouched.

    python -m tests.support.netns_client streams ADDRESS COUNT MAX_TOKENS BOUND   # greedy streams at once
    python -m tests.support.netns_client probe ADDRESS DEADLINE                   # SERVING, then one request

It prints one JSON object a line: `streams` a {"i", "t", "n"} per delta (t: time.monotonic(), the same clock in
every process of the machine) and a {"i", "t", "end", "details", "tokens", "prompt"} when a stream ends (end: ""
when it finished by itself, else the gRPC status name); `probe` one {"serving_after", "workers", "end", ...}.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc

VOCAB = 49152  # the tiny models share SmolLM2's tokenizer
_print_lock = threading.Lock()


def emit(**fields: object) -> None:
    with _print_lock:
        print(json.dumps(fields), flush=True)


def greedy(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def stream(stub: pb_grpc.GenerationStub, i: int, prompt: list[int], max_tokens: int, bound: float) -> list[int]:
    """One greedy stream to its end; a client deadline of `bound` seconds marks a hang (DEADLINE_EXCEEDED)."""
    tokens: list[int] = []
    end, details = "", ""
    try:
        for delta in stub.Generate(greedy(prompt, max_tokens), timeout=bound):
            tokens.extend(delta.token_ids)
            emit(i=i, t=time.monotonic(), n=len(delta.token_ids))
    except grpc.RpcError as exc:
        end, details = exc.code().name, exc.details() or ""
    emit(i=i, t=time.monotonic(), end=end, details=details, tokens=tokens, prompt=prompt)
    return tokens


def streams(address: str, count: int, max_tokens: int, bound: float) -> None:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    rng = random.Random(count * 1000 + max_tokens)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(count)]
    threads = [
        threading.Thread(target=stream, args=(stub, i, p, max_tokens, bound), daemon=True)
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def probe(address: str, deadline_s: float) -> None:
    """Wait (up to `deadline_s`) until health says SERVING, then list the workers and serve one request."""
    start = time.monotonic()
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    while True:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == serving:
                break
        except grpc.RpcError:
            pass
        if time.monotonic() - start > deadline_s:
            emit(serving_after=None, workers=[], end="NOT_SERVING", details=f"not SERVING in {deadline_s} s")
            return
        time.sleep(0.2)
    serving_after = time.monotonic() - start
    listed = pb_grpc.ControlStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
    workers = [{"rank": w.rank, "pid": w.pid, "state": w.state} for w in listed]
    tokens: list[int] = []
    end, details = "", ""
    try:
        for delta in pb_grpc.GenerationStub(channel).Generate(greedy([5, 6, 7, 8], 8), timeout=60):
            tokens.extend(delta.token_ids)
    except grpc.RpcError as exc:
        end, details = exc.code().name, exc.details() or ""
    emit(serving_after=serving_after, workers=workers, end=end, details=details, tokens=tokens)


def main(argv: list[str]) -> int:
    mode, address, *rest = argv
    if mode == "streams":
        streams(address, int(rest[0]), int(rest[1]), float(rest[2]))
    elif mode == "probe":
        probe(address, float(rest[0]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
