"""A DNS server on loopback for one test: it answers A queries with 127.0.0.1 while `up`, NXDOMAIN otherwise (a
Kubernetes pod's name while the pod is being replaced). A gRPC target names it as its authority:
`dns://127.0.0.1:PORT/some.name:GRPC_PORT` (gRPC's c-ares resolver asks that server)."""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType

NOERROR, NXDOMAIN = 0x8180, 0x8183  # response flags: recursion desired and available, rcode 0 or 3
A = 1


class LoopbackDns:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.up = False
        self.queries = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def target(self, name: str, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(512)
            except OSError:  # closed
                return
            self.queries += 1
            self.sock.sendto(self._answer(data), peer)

    def _answer(self, query: bytes) -> bytes:
        (tid,) = struct.unpack(">H", query[:2])
        end = 12  # the question's name: length-prefixed labels up to a zero byte, then type and class
        while query[end]:
            end += query[end] + 1
        question = query[12 : end + 5]
        (qtype,) = struct.unpack(">H", query[end + 1 : end + 3])
        if not self.up:
            return struct.pack(">HHHHHH", tid, NXDOMAIN, 1, 0, 0, 0) + question
        if qtype != A:  # AAAA and the rest: the name exists, with no such record
            return struct.pack(">HHHHHH", tid, NOERROR, 1, 0, 0, 0) + question
        record = b"\xc0\x0c" + struct.pack(">HHIH", A, 1, 1, 4) + socket.inet_aton("127.0.0.1")  # TTL 1 s
        return struct.pack(">HHHHHH", tid, NOERROR, 1, 1, 0, 0) + question + record

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> LoopbackDns:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
