"""Worker-to-worker KV transfer (worker_node/kv/transfer/exporter.py): a lease's blocks move byte for byte in every KV
format, batched into chunks; a layout that does not pair, an unknown lease, a corrupted frame, a silent exporter and
a client without CURVE keys are refused with a clear error and write nothing. Worlds of different TP sizes move
runs of KV heads: each consumer rank gets exactly its heads' bytes. Each of these holds for both paths: frames over
TCP and, between processes of one host, a shared-memory staging buffer (`staged`: every buffer made is gone at the
test's end; tests/worker_node/kv/transfer/test_staging.py has the rest of that path)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kernels.kv_quant import SCALE_DTYPE
from proto.curve import ensure_keys
from proto.kv_transfer import (
    ACK_MARK,
    KV_TRANSFER_VERSION,
    KVLayout,
    KVPull,
    KVTransferError,
    head_sources,
    pairing_problem,
)
from proto.kv_transfer import encode as encode_pull
from proto.wire import KVImport
from tests.support.waiting import wait_for
from worker_node.kv.cache import KVCache, LayerKV
from worker_node.kv.handoff import KVHandoff
from worker_node.kv.transfer import exporter as kv_transfer
from worker_node.kv.transfer.exporter import KVExporter, cache_layout, new_lease, pull_blocks
from worker_node.kv.transfer.frames import block_bytes
from worker_node.kv.transfer.staging import Staging

pytestmark = pytest.mark.unit

BLOCKS, BLOCK, HEADS, DIM, LAYERS = 8, 4, 2, 8, 3


def make_cache(
    dtype: torch.dtype, seed: int | None, blocks: int = BLOCKS, block_size: int = BLOCK, heads: int = HEADS
) -> KVCache:
    """Random contents when seeded (a producer), zeros otherwise (a consumer)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (blocks, block_size, heads, DIM)

    def fill(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        if gen is None:
            return torch.zeros(shape, dtype=dt)
        if dt == torch.int8:
            return torch.randint(-127, 127, shape, generator=gen, dtype=torch.int8)
        return torch.randn(shape, generator=gen).to(dt)

    layers = []
    for _ in range(LAYERS):
        k, v = fill(shape, dtype), fill(shape, dtype)
        if dtype in (torch.int8, torch.float8_e4m3fn):
            layers.append(LayerKV(k, v, fill(shape[:3], SCALE_DTYPE), fill(shape[:3], SCALE_DTYPE)))
        else:
            layers.append(LayerKV(k, v))
    return layers


def block(cache: KVCache, b: int) -> list[bytes]:
    return [t[b].contiguous().view(torch.uint8).numpy().tobytes() for layer in cache for t in layer.tensors()]


class Made(list[Staging]):
    """The staging buffers made, and the name each had when made (an acked one is renamed and kept as a spare)."""

    names: list[str]

    def gone(self) -> bool:
        """No name ever handed out opens anything now."""
        return not any((Path("/dev/shm") / n).exists() for n in self.names)


@pytest.fixture(autouse=True)
def staged(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    """Every staging buffer the exporters make; none may be left in /dev/shm once the test's exporters closed."""
    made = Made()
    made.names = []

    def recording(size: int, device: torch.device) -> Staging:
        made.append(real(size, device))
        made.names.append(made[-1].handle[0].decode())  # type: ignore[union-attr]
        return made[-1]

    real = kv_transfer.make_staging
    monkeypatch.setattr(kv_transfer, "make_staging", recording)
    yield made
    assert not [s for s in made if shm_path(s).exists()] and made.gone(), "a staging buffer left behind"


def shm_path(s: Staging) -> Path:
    return Path("/dev/shm") / s.handle[0].decode()  # type: ignore[union-attr]


@pytest.fixture
def exporter_of() -> Iterator:  # type: ignore[type-arg]
    made: list[KVExporter] = []

    def make(cache: KVCache, **kw: object) -> KVExporter:
        made.append(KVExporter(cache, cache_layout(cache), **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for e in made:
        e.close()


PATHS = pytest.mark.parametrize("same_host", [True, False], ids=["shm", "tcp"])


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_a_lease_moves_byte_for_byte_in_chunks(exporter_of, staged, dtype: torch.dtype, same_host: bool) -> None:  # type: ignore[no-untyped-def]
    src, dst = make_cache(dtype, seed=1), make_cache(dtype, seed=None)
    pulled: list[bytes] = []
    exporter = exporter_of(src, on_pulled=pulled.append)
    lease = new_lease()
    exporter.grant(lease, [1, 3, 5, 6])
    moved = pull_blocks(
        exporter.address, lease, dst, cache_layout(dst), [5, 1, 6], [0, 2, 7], max_chunk_bytes=2 * block_bytes(src),
        same_host=same_host,
    )  # fmt: skip  # frames: two chunks, 2 + 1 blocks; staged: one buffer
    assert moved == 3 * block_bytes(src)
    assert (exporter.pulls_staged, exporter.pulls_framed) == ((1, 0) if same_host else (0, 1))
    assert len(staged) == exporter.pulls_staged and staged.gone() and not exporter.num_staged, "let go on the ack"
    for s, d in [(5, 0), (1, 2), (6, 7)]:
        assert block(dst, d) == block(src, s)
    for untouched in (1, 3, 4, 5, 6):
        assert not any(any(x) for x in block(dst, untouched))
    # by frames the exporter revokes after its last send, which the pull may beat: wait (staged: before the ack's reply)
    wait_for(lambda: pulled == [lease] and exporter.num_leases == 0, 10, "a complete pull frees the lease")
    with pytest.raises(KVTransferError, match="unknown or expired"):
        pull_blocks(exporter.address, lease, dst, cache_layout(dst), [5], [0], timeout_s=5)


@pytest.mark.parametrize(
    ("consumer", "field"),
    [
        (lambda: make_cache(torch.int8, None), "format"),
        (lambda: make_cache(torch.float32, None, block_size=8), "block_size"),
        (lambda: make_cache(torch.float32, None)[:2], "num_layers"),
    ],
)
def test_layouts_that_do_not_pair_are_refused_naming_the_field(exporter_of, consumer, field: str) -> None:  # type: ignore[no-untyped-def]
    src, dst = make_cache(torch.float32, seed=2), consumer()
    exporter = exporter_of(src)
    lease = new_lease()
    exporter.grant(lease, [0])
    with pytest.raises(KVTransferError, match=f"do not pair: {field} is"):
        pull_blocks(exporter.address, lease, dst, cache_layout(dst), [0], [1], timeout_s=5)
    assert not any(any(x) for x in block(dst, 1))
    assert exporter.num_leases == 1, "a refused pull keeps the lease"


def test_tp_shape_and_rank_must_match() -> None:
    one = KVLayout("bfloat16", 16, 2, 2, 64)
    assert pairing_problem(one, one) is None
    assert "tensor_parallel_size is 1 here and 2" in str(pairing_problem(one, KVLayout("bfloat16", 16, 2, 2, 64, 2)))
    rank1 = KVLayout("bfloat16", 16, 2, 2, 64, 2, 1)
    assert "tensor_rank" in str(pairing_problem(KVLayout("bfloat16", 16, 2, 2, 64, 2, 0), rank1))
    assert pairing_problem(KVLayout("bfloat16", 16, 2, 2, 64, model="a"), KVLayout("bfloat16", 16, 2, 2, 64)) is None
    assert "model" in str(pairing_problem(KVLayout("f", 1, 1, 1, 1, model="a"), KVLayout("f", 1, 1, 1, 1, model="b")))


def test_blocks_outside_the_lease_are_refused(exporter_of) -> None:  # type: ignore[no-untyped-def]
    src, dst = make_cache(torch.float32, 3), make_cache(torch.float32, None)
    exporter = exporter_of(src)
    lease = new_lease()
    exporter.grant(lease, [2])
    with pytest.raises(KVTransferError, match=r"blocks \[3\] are not in the lease"):
        pull_blocks(exporter.address, lease, dst, cache_layout(dst), [2, 3], [0, 1], timeout_s=5)
    assert exporter.revoke(lease) and not exporter.revoke(lease)


class CorruptingExporter(KVExporter):
    def _send(self, ident, header, frames):  # type: ignore[no-untyped-def]
        if frames:
            frames = [frames[0].copy(), *frames[1:]]
            frames[0].reshape(-1)[0] ^= 0xFF
        super()._send(ident, header, frames)

    def _fill(self, staging, blocks, heads):  # type: ignore[no-untyped-def]
        places, sums = super()._fill(staging, blocks, heads)
        staging.tensor[places[0][0]] ^= 0xFF  # after the CRCs were taken
        return places, sums


@PATHS
def test_a_corrupted_frame_fails_its_checksum(same_host: bool) -> None:
    src, dst = make_cache(torch.float32, 4), make_cache(torch.float32, None)
    exporter = CorruptingExporter(src, cache_layout(src))
    try:
        lease = new_lease()
        exporter.grant(lease, [0])
        with pytest.raises(KVTransferError, match="checksum"):
            pull_blocks(exporter.address, lease, dst, cache_layout(dst), [0], [0], timeout_s=5, same_host=same_host)
        assert not any(any(x) for x in block(dst, 0))
        assert exporter.num_staged == 0, "a corrupt staging buffer is freed"
        # only the staged path hears of the failure (its ack): it keeps the lease; frames sent count as pulled
        wait_for(lambda: exporter.num_leases == same_host, 10, "the lease kept by the staged path only")
    finally:
        exporter.close()


def test_a_silent_exporter_times_out() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    dst = make_cache(torch.float32, None)
    try:
        with pytest.raises(KVTransferError, match="silent for 0.2 s"):
            pull_blocks(f"127.0.0.1:{port}", new_lease(), dst, cache_layout(dst), [0], [0], timeout_s=0.2)
    finally:
        mute.close(linger=0)


def test_curve_admits_the_worker_key_only(exporter_of, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    keys = ensure_keys(tmp_path / "curve")
    src, dst = make_cache(torch.bfloat16, 5), make_cache(torch.bfloat16, None)
    exporter = exporter_of(src, curve_dir=keys)
    lease = new_lease()
    exporter.grant(lease, [4])
    with pytest.raises(KVTransferError, match="silent"):  # no keys: the handshake never completes
        pull_blocks(exporter.address, lease, dst, cache_layout(dst), [4], [4], timeout_s=0.5)
    pull_blocks(exporter.address, lease, dst, cache_layout(dst), [4], [4], timeout_s=10, curve_dir=keys)
    assert block(dst, 4) == block(src, 4)


def test_concurrent_pulls_of_two_leases(exporter_of) -> None:  # type: ignore[no-untyped-def]
    src = make_cache(torch.float32, 6)
    exporter = exporter_of(src)
    dsts = [make_cache(torch.float32, None) for _ in range(2)]
    leases = [new_lease(), new_lease()]
    exporter.grant(leases[0], [0, 1, 2])
    exporter.grant(leases[1], [5, 6, 7])
    errors: list[BaseException] = []

    def pull(i: int) -> None:
        try:
            ids = [0, 1, 2] if i == 0 else [5, 6, 7]
            pull_blocks(exporter.address, leases[i], dsts[i], cache_layout(dsts[i]), ids, ids, timeout_s=10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert all(block(dsts[0], b) == block(src, b) for b in (0, 1, 2))
    assert all(block(dsts[1], b) == block(src, b) for b in (5, 6, 7))
    wait_for(lambda: exporter.num_leases == 0, 10, "both leases pulled")


def test_head_sources_cover_each_head_once() -> None:
    def layout(tp: int, rank: int, total: int = 2) -> KVLayout:
        return KVLayout("float32", 16, 2, max(1, total // tp), 8, tp, rank, total_kv_heads=total)

    assert head_sources(layout(1, 0), 2) == [(0, (0, 1), (0, 1)), (1, (0, 1), (1, 1))]  # TP 1 <- TP 2: concatenate
    assert head_sources(layout(2, 1), 1) == [(0, (1, 1), (0, 1))]  # TP 2 <- TP 1: slice
    assert head_sources(layout(1, 0), 4) == [(0, (0, 1), (0, 1)), (2, (0, 1), (1, 1))], "a replicated head once"
    assert head_sources(layout(4, 3), 2) == [(1, (0, 1), (0, 1))]
    assert "the model's KV heads are 2 here and 4" in str(pairing_problem(layout(1, 0), layout(2, 0, 4), True))
    assert pairing_problem(layout(1, 0), layout(2, 1), by_heads=True) is None
    assert "num_kv_heads is 2 here and 1" in str(pairing_problem(layout(1, 0), layout(2, 1)))


def heads_of(cache: KVCache, first: int, count: int) -> list[torch.Tensor]:
    return [t.narrow(2, first, count) for layer in cache for t in layer.tensors()]


@PATHS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_worlds_of_other_tp_sizes_move_runs_of_heads(exporter_of, dtype: torch.dtype, same_host: bool) -> None:  # type: ignore[no-untyped-def]
    """TP 1 -> TP 2 (each consumer rank slices out its head) and TP 2 -> TP 1 (the consumer concatenates both)."""
    whole = make_cache(dtype, seed=7)
    halves = [make_cache(dtype, seed=None, heads=1) for _ in range(2)]
    exporter = exporter_of(whole)
    lease = new_lease()
    exporter.grant(lease, [1, 4])
    for rank, half in enumerate(halves):
        layout = cache_layout(half, tp_size=2, tp_rank=rank)
        [(producer, heads, dst_heads)] = head_sources(layout, 1)
        assert producer == 0 and exporter.num_leases == 1, "the lease stays until every head was pulled"
        pull_blocks(
            exporter.address, lease, half, layout, [1, 4], [2, 3], 5, heads=heads, dst_heads=dst_heads,
            same_host=same_host,
        )  # fmt: skip
    assert (exporter.pulls_staged, exporter.pulls_framed) == ((2, 0) if same_host else (0, 2))
    wait_for(lambda: exporter.num_leases == 0, 10, "both heads pulled: the lease is done")
    for rank, half in enumerate(halves):
        for got, want in zip(heads_of(half, 0, 1), heads_of(whole, rank, 1), strict=True):
            assert torch.equal(got[[2, 3]].view(torch.uint8), want[[1, 4]].view(torch.uint8))
    back = make_cache(dtype, seed=None)
    layout = cache_layout(back)
    exporters = [KVExporter(h, cache_layout(h, 2, r)) for r, h in enumerate(halves)]
    try:
        for (rank, heads, dst_heads), e in zip(head_sources(layout, 2), exporters, strict=True):
            e.grant(lease, [2, 3])
            pull_blocks(
                e.address, lease, back, layout, [2, 3], [5, 6], 5, heads=heads, dst_heads=dst_heads,
                same_host=same_host,
            )  # fmt: skip
            assert e.pulls_staged == same_host
            assert rank == exporters.index(e)
            wait_for(lambda: e.num_leases == 0, 10, "its only head pulled: the lease is done")  # noqa: B023
    finally:
        for e in exporters:
            e.close()
    assert block(back, 5) == block(whole, 1) and block(back, 6) == block(whole, 4)
    with pytest.raises(KVTransferError, match=r"heads \[1, 2\]: not a run"):
        exporter.grant(lease, [1])
        pull_blocks(exporter.address, lease, back, layout, [1], [0], 5, heads=(1, 2), dst_heads=(0, 2))


FLOOD = 20_000


def test_a_flood_of_malformed_pulls_is_counted_in_a_few_log_lines(exporter_of, caplog) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: without CURVE anyone who reaches the exporter's port may send it anything. 20,000 malformed pulls,
    acks and frames of the wrong shape are each counted, cost the log a line or two, and a real pull after them
    still moves its blocks."""
    src, dst = make_cache(torch.float32, seed=5), make_cache(torch.float32, seed=None)
    exporter = exporter_of(src)
    garbage = [[b"\xc1"], [bytes(range(40))], [ACK_MARK, b"\xc1"], [b"a", b"b", b"c"], [encode_pull(KVPull(
        KV_TRANSFER_VERSION, new_lease(), cache_layout(dst), [0]))]]  # fmt: skip  # the last: an unknown lease
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # the whole flood queues (the refusals it gets back are never read)
    sock.connect(f"tcp://{exporter.address}")
    try:
        with caplog.at_level(logging.WARNING, "worker_node.kv.transfer.exporter"):
            for i in range(FLOOD):
                sock.send_multipart(garbage[i % len(garbage)])
            wait_for(lambda: exporter.drops.total >= FLOOD, 60, "every malformed pull counted")
            lease = new_lease()
            exporter.grant(lease, [2])
            pull_blocks(exporter.address, lease, dst, cache_layout(dst), [2], [0], timeout_s=10)
        logged = [r for r in caplog.records if r.name == "worker_node.kv.transfer.exporter"]
        assert len(logged) <= 2, f"{len(logged)} lines for {FLOOD} malformed pulls"
        assert exporter.drops.total == FLOOD
        assert block(dst, 0) == block(src, 2), "the exporter still serves"
    finally:
        sock.close()


def test_failed_imports_are_each_reported_and_logged_in_a_few_lines(exporter_of, caplog) -> None:  # type: ignore[no-untyped-def]
    """A producer that refuses every pull (here: leases it never granted) fails every import of every plan: each
    one is reported, for the scheduler to recompute, and the log grows by a line or two."""
    src, dst = make_cache(torch.float32, seed=6), make_cache(torch.float32, seed=None)
    exporter = exporter_of(src)
    handoff = KVHandoff(dst, cache_layout(dst), rank=0)
    imports = [KVImport([exporter.address], new_lease(), [0], [1], [b"h"]) for _ in range(300)]
    with caplog.at_level(logging.WARNING, "worker_node.kv.handoff"):
        run = handoff.pull(imports)
    assert run.failed == imports and handoff.failures.total == len(imports)
    logged = [r for r in caplog.records if r.name == "worker_node.kv.handoff"]
    assert len(logged) <= 2, f"{len(logged)} lines for {len(imports)} failed imports"
