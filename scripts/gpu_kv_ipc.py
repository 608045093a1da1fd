"""KV pulls between two processes of one host: the same-host staging path (a CUDA IPC handle on a GPU, a /dev/shm
segment on CPU) vs frames over TCP, on the same lease sizes in one run (scripts/gpu_check.py's `kv_ipc` part, and a
CPU benchmark on its own). This process is the producer (a `KVExporter` over a random cache of SmolLM2-135M's KV
shape: 30 layers, 3 KV heads of 64); a child process is the consumer: it pulls each lease into its own cache,
alternating the paths (staged, tcp, tcp, staged, ...), and reports each pull's seconds and a CRC of the blocks it
received, which must equal the producer's. On a busy CPU the wall time is mostly waiting for a core, so each pull's
CPU time is reported too: the consumer process's, plus the producer process's from that pull's request to the next
one's (its exporter and ZeroMQ threads; nothing else runs there meanwhile).

  python scripts/gpu_kv_ipc.py [--device cpu|cuda] [--tokens 4096] [--dtype bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from worker_node.kv.cache import KVCache, LayerKV  # noqa: E402
from worker_node.kv.transfer.exporter import KVExporter, cache_layout, new_lease, pull_blocks  # noqa: E402
from worker_node.kv.transfer.frames import block_bytes, export_frames  # noqa: E402

PATHS = ("staged", "tcp")


class TimedExporter(KVExporter):
    """Notes this process's CPU time at each pull's arrival (the pulls come one after another)."""

    marks: list[float]

    def _answer(self, ident: bytes, data: bytes) -> None:
        self.marks.append(time.process_time())
        super()._answer(ident, data)


@dataclass(frozen=True)
class KVIpcConfig:
    tokens: int = 4096  # a prompt's KV: tokens // block blocks
    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64
    block: int = 16
    dtype: str = "bfloat16"
    rounds: int = 3  # pulls per path (interleaved)
    device: str = "cuda"
    timeout_s: float = 120.0


def dry_run_config() -> KVIpcConfig:
    return KVIpcConfig(tokens=64, layers=2, rounds=1, device="cpu", timeout_s=60.0)


def make_cache(config: KVIpcConfig, seed: int | None) -> KVCache:
    """A cache of `tokens // block` blocks (+1), random when seeded (the producer), zeros otherwise."""
    dtype, device = getattr(torch, config.dtype), torch.device(config.device)
    shape = (config.tokens // config.block + 1, config.block, config.kv_heads, config.head_dim)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def fill() -> torch.Tensor:
        if gen is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    return [LayerKV(fill(), fill()) for _ in range(config.layers)]


def digest(cache: KVCache, blocks: list[int]) -> int:
    crc = 0
    for frame in export_frames(cache, blocks):
        crc = zlib.crc32(frame.data, crc)
    return crc


def kv_ipc_part(config: KVIpcConfig) -> dict[str, Any]:
    """Grant one lease per pull, let a child process pull them all, compare bytes and speeds."""
    one_thread(config)
    cache = make_cache(config, seed=0)
    exporter = TimedExporter(cache, cache_layout(cache))
    exporter.marks = []
    blocks = list(range(config.tokens // config.block))
    plan = [PATHS[(i + i // 2) % 2] for i in range(2 * config.rounds)]  # staged, tcp, tcp, staged, ...
    leases = [new_lease() for _ in plan]
    for lease in leases:
        exporter.grant(lease, blocks)
    job = {"config": asdict(config), "address": exporter.address, "pulls": [[x.hex(), p] for x, p in zip(leases, plan)]}
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--consume", json.dumps(job)],
            capture_output=True, text=True, timeout=config.timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        if child.returncode:
            raise RuntimeError(f"the consumer failed: {child.stderr[-2000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        marks = [*exporter.marks, time.process_time()]
    finally:
        exporter.close()
    producer_cpu = [b - a for a, b in zip(marks, marks[1:])]
    want = digest(cache, blocks)
    nbytes = len(blocks) * block_bytes(cache)
    rows = {}
    for path in PATHS:
        seconds = [s for s, p in zip(result["seconds"], plan, strict=True) if p == path]
        cpu = [c + q for c, q, p in zip(result["cpu"], producer_cpu, plan, strict=True) if p == path]
        rows[path] = {
            "GB/s": nbytes / statistics.median(seconds) / 1e9, "ms": [round(s * 1e3, 2) for s in seconds],
            "GB per CPU s": nbytes / statistics.median(cpu) / 1e9, "CPU ms": [round(c * 1e3, 2) for c in cpu],
        }  # fmt: skip
    same = all(c == want for c in result["crcs"])
    return {
        "device": config.device, "dtype": config.dtype, "tokens": config.tokens, "MB": nbytes / 1e6,
        "bytes identical": same, "staged pulls": exporter.pulls_staged, "framed pulls": exporter.pulls_framed,
        "staging kind": "cuda" if config.device.startswith("cuda") else "shm", **rows,
        "staged / tcp": rows["staged"]["GB/s"] / rows["tcp"]["GB/s"],
        "staged / tcp, CPU": rows["staged"]["GB per CPU s"] / rows["tcp"]["GB per CPU s"],
    }  # fmt: skip


def consume(job: dict[str, Any]) -> dict[str, Any]:
    """The child: pull each lease by its path into a fresh zeroed cache, timed (device work included)."""
    config = KVIpcConfig(**job["config"])
    one_thread(config)
    cache = make_cache(config, seed=None)
    blocks = list(range(config.tokens // config.block))
    seconds, cpu, crcs = [], [], []
    for lease, path in job["pulls"]:
        for layer in cache:
            for t in layer.tensors():
                t.zero_()
        sync(config)
        start, start_cpu = time.perf_counter(), time.process_time()
        pull_blocks(
            job["address"], bytes.fromhex(lease), cache, cache_layout(cache), blocks, blocks, config.timeout_s,
            same_host=path == "staged",
        )  # fmt: skip
        sync(config)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        crcs.append(digest(cache, blocks))
    return {"seconds": seconds, "cpu": cpu, "crcs": crcs}


def one_thread(config: KVIpcConfig) -> None:
    """On CPU each side copies with one thread (as a 1-thread worker would; idle OpenMP threads of one process
    would spin on the cores the other needs)."""
    if config.device == "cpu":
        torch.set_num_threads(1)


def sync(config: KVIpcConfig) -> None:
    if config.device.startswith("cuda"):
        torch.cuda.synchronize()


def summary_lines(part: dict[str, Any]) -> list[str]:
    if not part or "error" in part:
        return [f"| KV pull, same host | failed: {part['error']} |"] if part else []
    return [
        f"| KV pull, same host ({part['staging kind']}) | {part['staged']['GB/s']:.2f} GB/s vs TCP "
        f"{part['tcp']['GB/s']:.2f} GB/s ({part['staged / tcp']:.1f}x; {part['staged / tcp, CPU']:.1f}x in CPU time), "
        f"{part['MB']:.0f} MB, "
        f"bytes identical: {part['bytes identical']} |"
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=KVIpcConfig.tokens)
    p.add_argument("--dtype", default=KVIpcConfig.dtype)
    p.add_argument("--rounds", type=int, default=KVIpcConfig.rounds)
    p.add_argument("--consume", help=argparse.SUPPRESS)  # the child's job (JSON)
    args = p.parse_args(argv)
    if args.consume:
        print(json.dumps(consume(json.loads(args.consume))))
        return 0
    config = KVIpcConfig(tokens=args.tokens, dtype=args.dtype, rounds=args.rounds, device=args.device)
    print(json.dumps(kv_ipc_part(config), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
