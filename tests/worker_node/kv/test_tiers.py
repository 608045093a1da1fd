"""Greedy fidelity to HF for requests whose prefix came back from the KV offload tiers (RAM, disk, a warm disk
after a restart), and a corrupted or mismatched disk tier that is recomputed instead of loaded."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import torch

from scheduler_node.core.kv.block_ops import hash_block
from tests.support.engine import EngineRun, load_runner
from tests.support.models import assert_teacher_forced, load_hf
from worker_node.kv.cache import bytes_per_block
from worker_node.kv.tiers import HASH_BYTES, HEADER_BYTES, SUM_BYTES, DiskTier
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig

pytestmark = pytest.mark.e2e

BLOCK = 16
DEVICE_BLOCKS = 12
PREFIX = 48  # three full blocks


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    return load_hf(tiny_llama_dir)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def gib(folder: Path, blocks: int, per_block_extra: int = 0) -> float:
    """The GiB flag value that holds exactly `blocks` blocks of the tiny model in float32."""
    per = bytes_per_block(ModelConfig.from_folder(folder), BLOCK, torch.float32) + per_block_extra
    return (blocks * per + 1) / 2**30


def runner(folder: Path, ram_blocks: int = 0, disk: Path | None = None, disk_blocks: int = 64) -> ModelRunner:
    return load_runner(
        folder,
        DEVICE_BLOCKS,
        BLOCK,
        kv_offload_ram=gib(folder, ram_blocks),
        kv_offload_disk=str(disk or ""),
        kv_offload_disk_size=gib(folder, disk_blocks, HASH_BYTES + SUM_BYTES),
    )


def evict_then_return(run: EngineRun, rng: random.Random, prefix: list[int]) -> list:  # type: ignore[type-arg]
    """The prefix once, three unrelated prompts that take the whole device pool, then the prefix again."""
    first = run.add(prefix + tokens(rng, 5), 6)
    run.run()
    floods = []
    for _ in range(3):
        floods.append(run.add(tokens(rng, 64), 4))
        run.run()
    back = run.add(prefix + tokens(rng, 7), 8)
    run.run()
    return [first, *floods, back]


@pytest.mark.parametrize(
    ("ram_blocks", "with_disk"), [(32, False), (0, True), (2, True)], ids=["ram", "disk", "ram-then-disk"]
)
def test_prefix_back_from_a_tier_keeps_fidelity(
    tiny_llama_dir: Path, hf, tmp_path: Path, ram_blocks: int, with_disk: bool
) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    prefix = tokens(rng, PREFIX)
    r = runner(tiny_llama_dir, ram_blocks, tmp_path if with_disk else None)
    with EngineRun(r, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=64) as run:
        done = evict_then_return(run, rng, prefix)
        tiers = run.scheduler.tiers
        assert tiers is not None
        stats = tiers.snapshot()
    assert stats.hits_ram + stats.hits_disk == 3, "the three prefix blocks come back from the tiers"
    if with_disk:
        assert stats.hits_disk >= 1
    else:
        assert stats.hits_ram == 3
    for req in done:
        assert_teacher_forced(hf, req.prompt, req.output)


def test_a_disk_that_refuses_writes_drops_blocks_not_requests(
    tiny_llama_dir: Path, hf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The disk fills after two blocks (ENOSPC from the third write on): every request still completes with HF's
    tokens, the blocks not written are dropped, the disk tier turns off and the failure is counted. (A real full
    filesystem: tests/e2e/test_offload.py.)"""
    writes = [0]
    original = DiskTier.write

    def filling(self: DiskTier, slot: int, block_hash: bytes, payload: bytes) -> None:
        writes[0] += 1
        if writes[0] > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, slot, block_hash, payload)

    monkeypatch.setattr(DiskTier, "write", filling)
    rng = random.Random(9)
    prefix = tokens(rng, PREFIX)
    with EngineRun(runner(tiny_llama_dir, 0, tmp_path), tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=64) as run:
        done = evict_then_return(run, rng, prefix)
        done += evict_then_return(run, rng, prefix)  # after the tier turned off
        tiers = run.scheduler.tiers
        assert tiers is not None
        stats = tiers.snapshot()
        tiers.check_invariants()
    assert writes[0] > 2, "the test lost its point: the disk never refused a write"
    for req in done:
        assert [(c.error, c.finish_reason) for c in req.completions] == [("", "length")]
        assert_teacher_forced(hf, req.prompt, req.output)
    assert stats.failed_stores >= 1 and stats.disk_blocks_total == 0


def _fill_disk(folder: Path, disk: Path, rng: random.Random, prefix: list[int]) -> None:
    with EngineRun(runner(folder, 0, disk), tokenizer_dir=folder, max_num_batched_tokens=64) as run:
        evict_then_return(run, rng, prefix)


def _restart_and_ask(folder: Path, disk: Path, prompt: list[int]):  # type: ignore[no-untyped-def]
    with EngineRun(runner(folder, 0, disk), tokenizer_dir=folder, max_num_batched_tokens=64) as run:
        req = run.add(prompt, 8)
        run.run()
        tiers = run.scheduler.tiers
        assert tiers is not None
        return req, tiers.snapshot()


def test_warm_restart_hits_from_the_first_request(tiny_llama_dir: Path, hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(8)
    prefix = tokens(rng, PREFIX)
    _fill_disk(tiny_llama_dir, tmp_path, rng, prefix)
    req, stats = _restart_and_ask(tiny_llama_dir, tmp_path, prefix + tokens(rng, 3))
    assert stats.hits_disk == 3
    assert_teacher_forced(hf, req.prompt, req.output)


def _slot_of(disk_file: Path, record_bytes: int, block_hash: bytes) -> int:
    data = disk_file.read_bytes()
    for slot in range((len(data) - HEADER_BYTES) // record_bytes):
        start = HEADER_BYTES + slot * record_bytes
        if data[start : start + HASH_BYTES] == block_hash:
            return slot
    raise AssertionError("the block is not on disk")


def test_a_corrupted_disk_block_is_recomputed_not_loaded(tiny_llama_dir: Path, hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(9)
    prefix = tokens(rng, PREFIX)
    _fill_disk(tiny_llama_dir, tmp_path, rng, prefix)
    first = hash_block(None, prefix[:BLOCK])
    second = hash_block(first, prefix[BLOCK : 2 * BLOCK])
    disk_file = tmp_path / "rank0.kvtier"
    record = HASH_BYTES + SUM_BYTES + bytes_per_block(ModelConfig.from_folder(tiny_llama_dir), BLOCK, torch.float32)
    offset = HEADER_BYTES + _slot_of(disk_file, record, second) * record + HASH_BYTES + SUM_BYTES + 100
    with disk_file.open("r+b") as f:  # one flipped byte in the second block's payload
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    req, stats = _restart_and_ask(tiny_llama_dir, tmp_path, prefix + tokens(rng, 3))
    assert stats.hits_disk == 1, "only the block before the corrupted one is loaded; the rest is recomputed"
    assert_teacher_forced(hf, req.prompt, req.output)


def _damage(disk_file: Path, slot_offset: int, how: str) -> None:
    """Flip one byte of a record's payload, or cut the file short at the record (what a full disk or a stray
    truncation leaves)."""
    with disk_file.open("r+b") as f:
        if how == "truncate":
            f.truncate(slot_offset)
            return
        f.seek(slot_offset + HASH_BYTES + SUM_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _damaged_while_running(folder: Path, disk: Path, run: EngineRun, how: str, rank: int = 0) -> tuple:  # type: ignore[type-arg]
    """Put a prefix on disk, damage its second block in `rank`'s file (the index still holds it), then ask for
    the prefix twice at once (one request loads it, the other finds the loaded blocks in the device cache)."""
    rng = random.Random(12)
    prefix = tokens(rng, PREFIX)
    first = hash_block(None, prefix[:BLOCK])
    second = hash_block(first, prefix[BLOCK : 2 * BLOCK])
    per_block = bytes_per_block(ModelConfig.from_folder(folder), BLOCK, torch.float32) // len(run.workers.runners)
    record = HASH_BYTES + SUM_BYTES + per_block
    disk_file = disk / f"rank{rank}.kvtier"
    done = [run.add(prefix + tokens(rng, 5), 6)]
    run.run()
    for _ in range(3):  # unrelated prompts that take the whole device pool: the prefix goes to disk
        done.append(run.add(tokens(rng, 64), 4))
        run.run()
    tiers = run.scheduler.tiers
    assert tiers is not None and tiers.match([first, second]) == 2, "the prefix is on disk and indexed"
    _damage(disk_file, HEADER_BYTES + _slot_of(disk_file, record, second) * record, how)
    done += [run.add(prefix + tokens(rng, 7), 8), run.add(prefix + tokens(rng, 6), 5)]
    run.run()
    run.scheduler.blocks.check_invariants()
    tiers.check_invariants()
    return done, tiers.snapshot(), tiers.match([first, second])


def _assert_recomputed(hf, done: list, stats, offered: int, how: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    assert stats.failed_loads >= 1 and stats.hits_disk >= 1
    if how == "corrupt":
        assert stats.failed_loads == 1 and offered == 1, "the first block still comes from disk, the second not"
    for req in done:
        assert req.completions[0].error == "" and len(req.output) == req.max_tokens
        assert_teacher_forced(hf, req.prompt, req.output)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_a_disk_block_damaged_after_start_is_recomputed(
    tiny_llama_dir: Path, hf, tmp_path: Path, how: str, async_scheduling: bool
) -> None:  # type: ignore[no-untyped-def]
    """The tier index knows the block is on disk; its copy fails the check only when loaded: the requests that
    read it still complete (those blocks computed instead), the failure is counted, the block is not offered
    again."""
    r = runner(tiny_llama_dir, 0, tmp_path)
    engine = {"tokenizer_dir": tiny_llama_dir, "max_num_batched_tokens": 64, "async_scheduling": async_scheduling}
    with EngineRun(r, **engine) as run:  # type: ignore[arg-type]
        done, stats, offered = _damaged_while_running(tiny_llama_dir, tmp_path, run, how)
    _assert_recomputed(hf, done, stats, offered, how)


def test_a_block_damaged_on_one_tensor_parallel_rank_is_recomputed_by_all(
    tiny_llama_dir: Path, hf, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Only rank 1's copy fails: both ranks leave the same requests out (their collectives need equal batches)."""
    from tests.support.inprocess_tp import TensorParallelRanks

    ranks = TensorParallelRanks(
        tiny_llama_dir, DEVICE_BLOCKS, BLOCK, kv_offload_disk=str(tmp_path),
        kv_offload_disk_size=gib(tiny_llama_dir, 64, HASH_BYTES + SUM_BYTES),
    )  # fmt: skip
    try:
        with EngineRun(ranks.runners, tokenizer_dir=tiny_llama_dir, transport=ranks.transport(),
                       max_num_batched_tokens=64) as run:  # fmt: skip
            done, stats, offered = _damaged_while_running(tiny_llama_dir, tmp_path, run, "corrupt", rank=1)
    finally:
        ranks.close()
    _assert_recomputed(hf, done, stats, offered, "corrupt")


def test_a_disk_tier_of_another_layout_is_ignored(tiny_llama_dir: Path, hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(10)
    prefix = tokens(rng, PREFIX)
    _fill_disk(tiny_llama_dir, tmp_path, rng, prefix)
    disk_file = tmp_path / "rank0.kvtier"
    with disk_file.open("r+b") as f:
        header = f.read(HEADER_BYTES)
        assert b'"float32"' in header
        f.seek(0)
        f.write(header.replace(b'"float32"', b'"float16"'))  # as if written by a float16 worker
    req, stats = _restart_and_ask(tiny_llama_dir, tmp_path, prefix + tokens(rng, 3))
    assert stats.hits_disk == 0 and stats.disk_blocks_used == 0, "nothing adopted or loaded: the tier started afresh"
    assert_teacher_forced(hf, req.prompt, req.output)


def test_the_offload_benchmark_smoke(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """scripts/bench_kv_offload.py --smoke: every run gives the same greedy tokens; the tiers serve the returning
    prefixes (RAM, disk, and a warm disk from the first request), recompute never touches a tier. The timings are
    measured, not asserted (docs/benchmarks.md)."""
    import json
    import subprocess
    import sys

    from minivllm.cluster import REPO

    out_json = tmp_path / "out.json"
    out = subprocess.run([sys.executable, "scripts/bench_kv_offload.py", "--smoke", "--model", str(tiny_llama_dir),
                          "--threads", "1", "--json", str(out_json)], cwd=REPO, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| warm restart (disk) |" in out.stdout
    rows = {r["run"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["recompute"]["hits_ram"] + rows["recompute"]["hits_disk"] == 0
    assert rows["ram"]["hits_ram"] > 0 and rows["disk"]["hits_disk"] > 0
    assert rows["warm restart (disk)"]["hits_disk"] > 0


def test_tensor_parallel_ranks_keep_their_own_shards(tiny_llama_dir: Path, hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """TP 2: each rank offloads its half of the KV heads to its own RAM tier and disk file; a prefix that comes
    back through both tiers still matches HF."""
    from tests.support.inprocess_tp import TensorParallelRanks

    rng = random.Random(11)
    prefix = tokens(rng, PREFIX)
    half = gib(tiny_llama_dir, 2) / 2  # each rank's block is half the size: two blocks' worth of RAM each
    ranks = TensorParallelRanks(
        tiny_llama_dir, DEVICE_BLOCKS, BLOCK, kv_offload_ram=half, kv_offload_disk=str(tmp_path),
        kv_offload_disk_size=gib(tiny_llama_dir, 64, HASH_BYTES + SUM_BYTES),
    )  # fmt: skip
    try:
        with EngineRun(ranks.runners, tokenizer_dir=tiny_llama_dir, transport=ranks.transport(),
                       max_num_batched_tokens=64) as run:  # fmt: skip
            done = evict_then_return(run, rng, prefix)
            tiers = run.scheduler.tiers
            assert tiers is not None
            stats = tiers.snapshot()
    finally:
        ranks.close()
    assert stats.hits_ram + stats.hits_disk == 3 and stats.hits_disk >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.kvtier", "rank1.kvtier"]
    for req in done:
        assert_teacher_forced(hf, req.prompt, req.output)


def test_pipeline_stages_keep_their_own_layers(tiny_llama_dir: Path, hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """PP 2 with two plans in flight: each stage offloads its own layers' KV; a prefix that comes back through
    RAM and disk still matches HF."""
    from tests.support.stages import stage_runners

    rng = random.Random(12)
    prefix = tokens(rng, PREFIX)
    runners = stage_runners(
        tiny_llama_dir, DEVICE_BLOCKS, BLOCK, stages=2, kv_offload_ram=gib(tiny_llama_dir, 2) / 2,
        kv_offload_disk=str(tmp_path), kv_offload_disk_size=gib(tiny_llama_dir, 64, HASH_BYTES + SUM_BYTES),
    )  # fmt: skip
    with EngineRun(runners, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=64) as run:
        done = evict_then_return(run, rng, prefix)
        tiers = run.scheduler.tiers
        assert tiers is not None
        stats = tiers.snapshot()
    assert stats.hits_ram + stats.hits_disk == 3 and stats.hits_disk >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.kvtier", "rank1.kvtier"]
    for req in done:
        assert_teacher_forced(hf, req.prompt, req.output)
