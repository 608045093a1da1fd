"""Where a worker joins: the address it was given, or the one the scheduler's gRPC port names.

Article 003 points each worker at the scheduler's gRPC address (`--scheduler-address H:50051`); the workers' socket
is another port (ZeroMQ, `--worker-port`). Both ends speak first when a connection opens, and differently: a
ZeroMQ socket sends its greeting (0xFF ...), an HTTP/2 server (gRPC) its SETTINGS frame. So the worker opens one
TCP connection and listens: a greeting means it was given the workers' socket, kept as it is; a SETTINGS frame
means a gRPC port, which it asks for the workers' socket with one unary call (proto WORKER_JOIN_PATH), written
here as bare HTTP/2 frames: a worker never imports grpc. Only cleartext gRPC is asked: behind --tls-cert the
worker is given the worker socket's own address.
"""

from __future__ import annotations

import socket
import struct
import time

from proto.session_messages import WORKER_JOIN_PATH

ZMTP_SIGNATURE = 0xFF  # the first byte of a ZeroMQ greeting
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
WILDCARDS = ("0.0.0.0", "::", "[::]", "*", "")
RETRY_S = 0.1  # between tries while nothing listens yet (the scheduler may start after its workers)


class JoinAddressError(ValueError):
    """The address answers, but not as a scheduler: named, with what to give instead."""


def join_address(address: str, timeout: float, local_address: str = "") -> str:
    """HOST:PORT of the workers' ZeroMQ socket: `address` itself when it is that socket, or what the scheduler's
    gRPC port at `address` names. Retries while nothing listens, for `timeout` seconds (then TimeoutError)."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with _connect(host, port, deadline, local_address) as conn:
                first = _first_bytes(conn, deadline)
                if first[:1] == bytes([ZMTP_SIGNATURE]):
                    return address
                if len(first) >= 9 and first[3] == SETTINGS:
                    return _with_host(_ask(conn, address, first, deadline), host)
                raise JoinAddressError(
                    f"--scheduler-address {address} is neither the scheduler's gRPC port nor its workers' socket "
                    f"(it answered {first[:16]!r})"
                )
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError) as exc:
            if time.monotonic() + RETRY_S >= deadline:
                raise TimeoutError(f"no scheduler answered at {address} within {timeout:g} s ({exc})") from None
            time.sleep(RETRY_S)


def split_address(address: str) -> tuple[str, int]:
    """('host', port) of HOST:PORT or [v6]:PORT; ValueError naming --scheduler-address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--scheduler-address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _with_host(endpoint: str, asked_host: str) -> str:
    """The scheduler's answer, a wildcard bind address replaced by the host the worker reached it at."""
    host, port = split_address(endpoint)
    if host in WILDCARDS:
        host = asked_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect(host: str, port: int, deadline: float, local_address: str) -> socket.socket:
    source = (local_address, 0) if local_address else None
    return socket.create_connection((host, port), timeout=_left(deadline), source_address=source)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("out of time")
    return left


def _first_bytes(conn: socket.socket, deadline: float) -> bytes:
    conn.settimeout(min(_left(deadline), 5.0))
    data = conn.recv(64)
    if not data:
        raise ConnectionResetError("closed at once")
    return data


def _ask(conn: socket.socket, address: str, first: bytes, deadline: float) -> str:
    """One unary call of WORKER_JOIN_PATH on the HTTP/2 connection `conn` whose first bytes were `first`."""
    headers = b"".join(
        _literal(name, value)
        for name, value in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", WORKER_JOIN_PATH),
            (":authority", address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    conn.sendall(
        PREFACE
        + _frame(SETTINGS, 0, 0, b"")
        + _frame(HEADERS, END_HEADERS, 1, headers)
        + _frame(DATA, END_STREAM, 1, b"\x00\x00\x00\x00\x00")  # an empty, uncompressed message
    )
    reader = _Frames(conn, first, deadline)
    body = b""
    while True:
        kind, flags, stream, payload = reader.next()
        if kind == SETTINGS and not flags & ACK:
            conn.sendall(_frame(SETTINGS, ACK, 0, b""))
        elif kind == PING and not flags & ACK:
            conn.sendall(_frame(PING, ACK, 0, payload))
        elif kind == GOAWAY or (kind == RST_STREAM and stream == 1):
            break
        elif kind == DATA and stream == 1:
            body += _unpadded(flags, payload)
            if len(body) >= 5 and len(body) >= 5 + struct.unpack(">I", body[1:5])[0]:
                return body[5 : 5 + struct.unpack(">I", body[1:5])[0]].decode()
        if stream == 1 and flags & END_STREAM:
            break
    raise JoinAddressError(
        f"--scheduler-address {address} speaks gRPC but does not say where workers join: not a minivllm scheduler, "
        "or one older than this worker; give its --worker-host:--worker-port instead"
    )


class _Frames:
    """HTTP/2 frames off a socket, starting with bytes already read."""

    def __init__(self, conn: socket.socket, first: bytes, deadline: float) -> None:
        self.conn, self.buffer, self.deadline = conn, first, deadline

    def next(self) -> tuple[int, int, int, bytes]:
        header = self._take(9)
        length = int.from_bytes(header[:3], "big")
        stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        return header[3], header[4], stream, self._take(length)

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self.conn.settimeout(_left(self.deadline))
            more = self.conn.recv(65536)
            if not more:
                raise ConnectionResetError("the scheduler closed the connection")
            self.buffer += more
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return taken


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK header field, literal without indexing, new name, no Huffman coding (RFC 7541, 6.2.2)."""
    return b"\x00" + _string(name.encode()) + _string(value.encode())


def _string(data: bytes) -> bytes:
    """An HPACK string: its length as a 7-bit prefix integer (RFC 7541, 5.1), then the octets."""
    n, out = len(data), bytearray()
    if n < 127:
        out.append(n)
    else:
        out.append(127)
        n -= 127
        while n >= 128:
            out.append(n % 128 + 128)
            n //= 128
        out.append(n)
    return bytes(out) + data


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED or not payload:
        return payload
    return payload[1 : len(payload) - payload[0]]
