"""Where a worker joins (worker_node/join_address.py): the workers' socket itself is kept (its ZeroMQ greeting
tells it apart), a gRPC port that does not name one is an error saying what to give instead, an address where
nothing listens times out naming it. The scheduler's own answer: tests/scheduler_node/cli/test_join_door.py."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import zmq

from worker_node.join_address import JoinAddressError, join_address, split_address

pytestmark = pytest.mark.unit


def test_the_workers_socket_is_kept_as_it_is() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        assert join_address(f"127.0.0.1:{port}", 5.0) == f"127.0.0.1:{port}"
    finally:
        router.close(linger=0)
        ctx.term()


def test_a_grpc_port_that_names_no_worker_socket_is_an_error() -> None:
    async def scenario() -> str:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with pytest.raises(JoinAddressError) as caught:
                await asyncio.get_running_loop().run_in_executor(None, join_address, f"127.0.0.1:{port}", 5.0)
        finally:
            await server.stop(None)
        return str(caught.value)

    assert "speaks gRPC but does not say where workers join" in asyncio.run(scenario())


def test_another_protocol_is_named() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def greet() -> None:
        conn, _ = listener.accept()
        conn.sendall(b"SSH-2.0-OpenSSH\r\n")
        conn.close()

    loop = asyncio.new_event_loop()
    try:
        greeter = loop.run_in_executor(None, greet)
        with pytest.raises(JoinAddressError, match="neither the scheduler's gRPC port nor its workers' socket"):
            join_address(f"127.0.0.1:{port}", 5.0)
        loop.run_until_complete(greeter)
    finally:
        loop.close()
        listener.close()


def test_nothing_listening_times_out_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(TimeoutError, match=f"no scheduler answered at 127.0.0.1:{port} within 0.3 s"):
            join_address(f"127.0.0.1:{port}", 0.3)


def test_an_address_is_host_and_port() -> None:
    assert split_address("10.0.0.1:50051") == ("10.0.0.1", 50051) and split_address("[::1]:5") == ("::1", 5)
    for bad in ("10.0.0.1", ":50051", "host:port"):
        with pytest.raises(ValueError, match="--scheduler-address must be HOST:PORT"):
            split_address(bad)
