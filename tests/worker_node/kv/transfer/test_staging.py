"""Same-host KV pulls through a staging buffer (staging.py): a /dev/shm segment of mode 0600 under a
random name, freed on the consumer's ack, on the lease's revoke (a consumer gone mid-pull: the lease expires) and at
the exporter's close; frames over TCP whenever the hosts differ, the buffer cannot be made or opened, or it would
pass the exporter's staging limit. Bytes moved by this path are checked in tests/test_exporter.py."""

from __future__ import annotations

import stat

import pytest
import torch
import zmq

from proto.kv_transfer import DEFAULT_CHUNK_BYTES, KV_TRANSFER_VERSION, KVPull, KVStaging, decode_chunk, encode
from tests.support.waiting import wait_for
from tests.worker_node.kv.transfer.test_exporter import block, exporter_of, make_cache, shm_path, staged
from worker_node.kv.transfer import exporter as kv_transfer
from worker_node.kv.transfer import pull as kv_pull
from worker_node.kv.transfer.exporter import KVExporter, cache_layout, new_lease
from worker_node.kv.transfer.pull import pull_blocks
from worker_node.kv.transfer.staging import StagingError, host_id, make_staging, open_staging

pytestmark = pytest.mark.unit

__all__ = ["exporter_of", "staged"]  # fixtures shared with the transfer tests


def test_a_segment_is_private_random_and_freed() -> None:
    one, two = make_staging(4096, torch.device("cpu")), make_staging(4096, torch.device("cpu"))
    try:
        path = shm_path(one)  # type: ignore[arg-type]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and one.handle != two.handle
        one.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        with open_staging("shm", one.handle, 4096, torch.device("cpu")) as seen:
            assert seen[:4].tolist() == [1, 2, 3, 4]
        one.free()
        one.free()
        assert not path.exists()
    finally:
        one.free()
        two.free()


@pytest.mark.parametrize(
    ("kind", "handle"),
    [
        ("shm", [b"../../etc/passwd"]),
        ("shm", [b"minivllm-kv-" + b"0" * 31]),
        ("shm", [b"minivllm-kv-" + b"0" * 32 + b"\n"]),  # `$` matched before a final newline
        ("gloo", [b"x"]),
        ("cuda", [1, 2]),
    ],
)
def test_a_malformed_handle_is_refused(kind: str, handle: list[bytes | int | bool]) -> None:
    with pytest.raises(StagingError, match="not a"), open_staging(kind, handle, 1, torch.device("cpu")):
        pass


def raw_staged_pull(exporter: KVExporter, lease: bytes, blocks: list[int]) -> KVStaging:
    """A same-host pull by a consumer that then vanishes without acking (killed mid-pull)."""
    layout = cache_layout(exporter.cache)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://{exporter.address}")
        sock.send(encode(KVPull(KV_TRANSFER_VERSION, lease, layout, blocks, DEFAULT_CHUNK_BYTES, [], host_id())))
        assert sock.poll(10_000), "the exporter answers"
        chunk = decode_chunk(sock.recv())
    finally:
        sock.close(linger=0)
    assert chunk.staging is not None and not chunk.error, chunk.error
    return chunk.staging


def test_a_consumer_gone_mid_pull_leaves_nothing_once_the_lease_expires(exporter_of, staged) -> None:  # type: ignore[no-untyped-def]
    src = make_cache(torch.float32, seed=1)
    exporter = exporter_of(src)
    lease, other = new_lease(), new_lease()
    exporter.grant(lease, [0, 1])
    exporter.grant(other, [2])
    raw_staged_pull(exporter, lease, [0, 1])
    raw_staged_pull(exporter, other, [2])
    assert exporter.num_staged == 2 and all(shm_path(s).exists() for s in staged)
    assert exporter.revoke(lease)  # what the lease's expiry (or an abort) does on the worker
    assert exporter.num_staged == 1 and not shm_path(staged[0]).exists() and shm_path(staged[1]).exists()
    exporter.close()  # and at shutdown, the rest
    assert exporter.num_staged == 0 and not shm_path(staged[1]).exists()


def test_an_acked_buffer_is_renamed_and_kept_for_the_next_pull(exporter_of, staged) -> None:  # type: ignore[no-untyped-def]
    """Its pages stay in (a fresh segment's page faults cost more than the copy); the name its consumer knew opens
    nothing; a bigger pull replaces it; close removes it (the `staged` fixture checks)."""
    src, dst = make_cache(torch.float32, seed=4), make_cache(torch.float32, seed=None)
    exporter = exporter_of(src)
    for i, blocks in enumerate(([0, 1], [2], [3, 4, 5])):
        lease = new_lease()
        exporter.grant(lease, blocks)
        pull_blocks(exporter.address, lease, dst, cache_layout(dst), blocks, blocks, timeout_s=10)
        assert all(block(dst, b) == block(src, b) for b in blocks)
        assert exporter.pulls_staged == i + 1 and len(staged) == [1, 1, 2][i], "a smaller pull reuses the spare"
    assert staged.gone(), "the names handed out open nothing"
    first = [staged.names[0].encode()]
    with pytest.raises(StagingError, match="cannot open"), open_staging("shm", first, 1, torch.device("cpu")):
        pass


def test_other_hosts_get_frames(exporter_of, staged) -> None:  # type: ignore[no-untyped-def]
    src, dst = make_cache(torch.bfloat16, seed=2), make_cache(torch.bfloat16, seed=None)
    exporter = exporter_of(src)
    exporter.host = "elsewhere/another-boot"
    lease = new_lease()
    exporter.grant(lease, [3])
    pull_blocks(exporter.address, lease, dst, cache_layout(dst), [3], [4], timeout_s=10)
    assert (exporter.pulls_staged, exporter.pulls_framed) == (0, 1) and not staged
    assert block(dst, 4) == block(src, 3)
    refusing = exporter_of(src, same_host=False)  # the producer's own choice (--kv-transfer tcp)
    refusing.grant(lease, [3])
    pull_blocks(refusing.address, lease, dst, cache_layout(dst), [3], [5], timeout_s=10)
    assert refusing.pulls_framed == 1 and not staged


def test_no_buffer_means_frames(exporter_of, staged, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The segment cannot be made (a full /dev/shm), would pass the exporter's limit, or cannot be opened by the
    consumer (another /dev/shm): the pull goes by frames, and the buffer made for nothing is freed."""
    src, dst = make_cache(torch.int8, seed=3), make_cache(torch.int8, seed=None)
    small = exporter_of(src, staging_limit=1)
    lease = new_lease()
    small.grant(lease, [1])
    pull_blocks(small.address, lease, dst, cache_layout(dst), [1], [1], timeout_s=10)
    assert small.pulls_framed == 1 and not staged and block(dst, 1) == block(src, 1)

    def no_room(size: int, device: torch.device) -> None:
        raise StagingError("no room")

    # Recorded from the exporter's first pull: it calls on_pulled on its own thread after the last frame is sent, so
    # a hook set between two pulls could still hear of the first one.
    pulled: list[bytes] = []
    exporter = exporter_of(src)
    exporter.on_pulled = pulled.append
    monkeypatch.setattr(kv_transfer, "make_staging", no_room)
    # A fresh lease per grant, as the scheduler makes them: the exporter forgets a pulled lease on its own thread,
    # which may come after the test's next grant of the same bytes.
    lease = first = new_lease()
    exporter.grant(lease, [2])
    pull_blocks(exporter.address, lease, dst, cache_layout(dst), [2], [2], timeout_s=10)
    assert exporter.pulls_framed == 1 and block(dst, 2) == block(src, 2)

    def unreachable(kind: str, handle: object, size: int, device: torch.device) -> None:
        raise StagingError("another /dev/shm")

    monkeypatch.setattr(kv_transfer, "make_staging", staged_recorder(staged))
    monkeypatch.setattr(kv_pull, "open_staging", unreachable)
    lease = new_lease()
    exporter.grant(lease, [5])
    pull_blocks(exporter.address, lease, dst, cache_layout(dst), [5], [6], timeout_s=10)
    assert (exporter.pulls_staged, exporter.pulls_framed) == (1, 2) and block(dst, 6) == block(src, 5)
    assert len(staged) == 1 and staged.gone() and exporter.num_staged == 0
    wait_for(lambda: pulled == [first, lease], 10, "each lease pulled once, by its frames")


def staged_recorder(made: list) -> object:  # type: ignore[type-arg]
    def recording(size: int, device: torch.device) -> object:
        made.append(make_staging(size, device))
        return made[-1]

    return recording
