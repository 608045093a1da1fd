"""vllm-client: stream a prompt (or a chat message) from the command line and print text as it arrives."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.api.validation import NO_CHAT_TEMPLATE
from settings.commands import command_parser
from settings.config_file import parse_args

# A newcomer's first command should answer in seconds, not ramble to the end of an 8,192-token context.


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "vllm-client",
        "Stream an answer from a minivllm server: the prompt goes through the model's chat template when it has "
        "one (--no-chat sends it as raw text to complete), and at most --max-tokens (256) come back. `vllm-client "
        "stats` prints the server's KV-cache and queue statistics instead; `vllm-client health` checks "
        "grpc.health.v1 (exit 0: SERVING); `vllm-client drain` stops admitting and waits up to --timeout for "
        "running requests (--migrate: moves them to other replicas behind vllm-router).",
    )
    # The one argument that is no setting: what this call asks (no config key, no environment).
    p.add_argument("prompt", nargs="?", help="the prompt text (read from stdin when omitted)")
    return p


def build_request(args: argparse.Namespace, prompt: str, chat: bool) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(request_id=args.request_id, sampling=sampling, model=args.model)
    if chat:
        request.messages.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    return request


def make_channel(args: argparse.Namespace) -> grpc.Channel:
    """A plain channel, or a TLS one with --tls / --tls-ca."""
    target = f"{args.host}:{args.port}"
    if not (args.tls or args.tls_ca):
        return grpc.insecure_channel(target)
    roots = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(roots), options)


def wait_ready(channel: grpc.Channel, timeout: float) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    return False


def print_stats(channel: grpc.Channel, args: argparse.Namespace) -> int:
    """`vllm-client stats`: the server's memory and queue figures (Control.GetStats)."""
    try:
        stats = pb_grpc.ControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=args.timeout, metadata=_auth(args))
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    for field in stats.DESCRIPTOR.fields:
        if field.name == "memory":
            continue
        value = getattr(stats, field.name)
        print(f"{field.name:24} {value:.4f}" if isinstance(value, float) else f"{field.name:24} {value}")
    for pool in stats.memory:
        print(
            f"memory {pool.tier:6} {pool.format:9} used {pool.used_bytes} of {pool.allocated_bytes} bytes "
            f"({_gib(pool.used_bytes)} of {_gib(pool.allocated_bytes)} GiB; {pool.used_blocks} of {pool.total_blocks} "
            f"blocks of {pool.bytes_per_block} bytes); prefix-cache hits {pool.hits} tokens"
        )
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def print_health(channel: grpc.Channel, args: argparse.Namespace) -> int:
    """`vllm-client health`: print the grpc.health.v1 status of --health-service; 0 when SERVING (a probe)."""
    request = health_pb2.HealthCheckRequest(service=args.health_service)
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def drain(channel: grpc.Channel, args: argparse.Namespace) -> int:
    """`vllm-client drain`: stop admitting, wait up to --timeout for running requests (a preStop hook); 0 when
    every one finished."""
    request = pb.DrainRequest(timeout_s=args.timeout, migrate=args.migrate)
    try:
        reply = pb_grpc.ControlStub(channel).Drain(request, timeout=args.timeout + 5, metadata=_auth(args))
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print("drained" if reply.drained else f"{reply.remaining} request(s) still running")
    return 0 if reply.drained else 1


def _auth(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    token = getattr(args, "control_token", None)
    return [("authorization", f"Bearer {token}")] if token else None


def stream(stub: pb_grpc.GenerationStub, args: argparse.Namespace, prompt: str) -> int:
    """Print the answer as it arrives. Without --chat/--no-chat the prompt goes as a chat message first; a server
    that refuses `messages` (INVALID_ARGUMENT naming that field: the model has no chat template) gets it again as
    raw text, before anything was printed."""
    chat = args.chat is not False
    try:
        for resp in stub.Generate(build_request(args, prompt, chat), timeout=args.timeout):
            prefix = f"[{resp.index}] " if args.n and args.n > 1 and resp.text else ""
            print(prefix + resp.text, end="", flush=True)
            if resp.finish_reason:
                u = resp.usage
                print(
                    f"\n[{resp.finish_reason}: {u.prompt_tokens} prompt + {u.completion_tokens} tokens]",
                    file=sys.stderr,
                )
    except grpc.RpcError as exc:
        if args.chat is None and chat and _refuses_messages(exc):
            args.chat = False
            return stream(stub, args, prompt)
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _refuses_messages(exc: grpc.RpcError) -> bool:
    details = exc.details() or ""
    return (
        exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        and details.startswith("messages")
        and NO_CHAT_TEMPLATE in details
    )


MODES = {"stats": print_stats, "health": print_health, "drain": drain}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = MODES.get(argv[0]) if argv else None
    args = parse_args(build_parser(), argv[1:] if mode else argv)
    if mode:
        with make_channel(args) as channel:
            return mode(channel, args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        channel = make_channel(args)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel:
        if args.wait_ready and not wait_ready(channel, args.wait_ready):
            print(
                f"error: no SERVING server at {args.host}:{args.port} after {args.wait_ready} s",
                file=sys.stderr,
            )
            return 1
        return stream(pb_grpc.GenerationStub(channel), args, prompt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
