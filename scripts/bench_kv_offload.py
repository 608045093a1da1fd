"""KV offload tiers benchmark: shared prefixes that exceed the device KV pool several times over.

Each of P prefixes ("documents" of L tokens) is asked once, which fills the device pool many times over and
evicts most of them; then every prefix comes back with a new question, one request at a time. The time to first
token of those returning requests (one generated token each, so the call's latency is its TTFT) is measured:

- recompute: no offload tier, an evicted prefix is computed again;
- ram: `--kv-offload-ram`, evicted blocks wait in host RAM and are loaded back;
- disk: `--kv-offload-disk` only, evicted blocks go to a file and are read back (checksums verified);
- warm restart: a new engine over the disk tier the previous run left: the returning prefixes hit from the
  first request, without any first pass.

Every run must give the same greedy tokens; the table reports mean TTFT, its ratio to recompute, and tier hits.
A second table splits the steps that loaded blocks back: blocks per step, the load's milliseconds (it runs before
the forward pass, so it adds to the step) and the whole step's. A last line gives what a prefetch thread could take
off such a step: reading and checking one prefix's blocks from a disk tier file (filling the device blocks stays
in the step).

    .venv/bin/python scripts/bench_kv_offload.py [--model default] [--json out.json]
    .venv/bin/python scripts/bench_kv_offload.py --smoke --model TINY_MODEL_DIR   (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm import LLM, SamplingParams  # noqa: E402
from scheduler_node.engine.model_path import resolve_model  # noqa: E402
from worker_node.kv.tiers import HASH_BYTES, DiskLayout, DiskTier  # noqa: E402


@dataclass(frozen=True, slots=True)
class Workload:
    prefixes: int  # distinct shared prefixes
    prefix_len: int  # tokens each
    question_len: int  # tokens after the prefix
    device_blocks: int  # the device KV pool
    tier_gib: float  # RAM tier and disk tier size each


FULL = Workload(prefixes=12, prefix_len=512, question_len=16, device_blocks=96, tier_gib=0.5)
SMOKE = Workload(prefixes=6, prefix_len=64, question_len=8, device_blocks=12, tier_gib=0.01)


def prompts(w: Workload, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """The first pass (each prefix with one question) and the returning pass (each with another)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 49152) for _ in range(w.prefix_len)] for _ in range(w.prefixes)]

    def ask(doc: list[int]) -> list[int]:
        return doc + [rng.randrange(3, 49152) for _ in range(w.question_len)]

    return [ask(d) for d in docs], [ask(d) for d in docs]


def run(model: Path, w: Workload, name: str, tiers: dict, threads: int, first_pass: bool) -> dict:
    first, returning = prompts(w, seed=0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    with LLM(str(model), num_kv_blocks=w.device_blocks, threads=threads, **tiers) as llm:
        llm.generate(first[:1], params, use_tqdm=False)  # warm-up: kernels, first-step allocations
        if first_pass:
            llm.generate(first[1:], params, use_tqdm=False)
        ttft, tokens = [], []
        for prompt in returning:
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            ttft.append(time.perf_counter() - start)
            tokens.append(out.outputs[0].token_ids)
        s = llm.engine.scheduler
        stats = s.tiers.snapshot() if s.tiers is not None else None
    return {
        "run": name,
        "mean_ttft_s": statistics.mean(ttft),
        "tokens": tokens,
        "hits_ram": stats.hits_ram if stats else 0,
        "hits_disk": stats.hits_disk if stats else 0,
        "mean_move_ms": stats.mean_move_ms if stats else 0.0,
        "gib_moved": stats.bytes_moved / 2**30 if stats else 0.0,
        "load_steps": stats.load_steps if stats else 0,
        "blocks_per_load_step": (stats.hits_ram + stats.hits_disk) / stats.load_steps
        if stats and stats.load_steps
        else 0,
        "mean_load_ms": stats.load_ms / stats.load_steps if stats and stats.load_steps else 0.0,
        "mean_load_step_ms": stats.load_step_ms / stats.load_steps if stats and stats.load_steps else 0.0,
    }


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1e3


def read_probe(model: Path, w: Workload, threads: int, repeats: int) -> dict:
    """What a prefetch thread could take off a loading step: reading and checking one prefix's blocks from a disk
    tier file (page cache warm), the fastest of `repeats` tries. Filling the device blocks stays in the step (the
    plan before it may still be using them)."""
    blocks = w.prefix_len // 16
    with LLM(str(model), num_kv_blocks=w.device_blocks, threads=threads) as llm:
        block_bytes = llm.engine.workers.capacity.bytes_per_block
    with tempfile.TemporaryDirectory(prefix="kv-tier-probe-") as d:
        disk = DiskTier(
            Path(d) / "probe.kvtier", DiskLayout("probe", "probe", 16, 0, 0, 0, 0, 1, 1, blocks, block_bytes)
        )
        keys = [i.to_bytes(HASH_BYTES, "little") for i in range(1, blocks + 1)]
        for slot, key in enumerate(keys):
            disk.write(slot, key, os.urandom(block_bytes))

        def load() -> None:
            for slot, key in enumerate(keys):
                disk.read(slot, key)

        read_ms = min(timed(load) for _ in range(repeats))
        disk.close()
    return {"blocks": blocks, "block_bytes": block_bytes, "read_ms": read_ms}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model folder or name (default: SmolLM2-135M)")
    p.add_argument("--smoke", action="store_true", help="a tiny workload (CI)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    model = resolve_model(args.model)
    w = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="kv-tier-") as disk:
        ram = {"kv_offload_ram": w.tier_gib}
        on_disk = {"kv_offload_disk": disk, "kv_offload_disk_size": w.tier_gib}
        rows = [
            run(model, w, "recompute", {}, args.threads, True),
            run(model, w, "ram", ram, args.threads, True),
            run(model, w, "disk", on_disk, args.threads, True),
            run(model, w, "warm restart (disk)", on_disk, args.threads, False),
        ]
    probe = read_probe(model, w, args.threads, repeats=1 if args.smoke else 7)
    base = rows[0]["mean_ttft_s"]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(
        f"{w.prefixes} prefixes of {w.prefix_len} tokens (+{w.question_len}), device pool {w.device_blocks} blocks "
        f"of 16 tokens: the prefixes need {w.prefixes * w.prefix_len / (16 * w.device_blocks):.1f}x the pool"
    )
    print(
        "| run | mean TTFT of returning prefixes (s) | vs recompute | RAM hits | disk hits | GiB moved "
        "| ms/step moving |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['mean_ttft_s']:.3f} | {base / r['mean_ttft_s']:.2f}x | {r['hits_ram']} "
            f"| {r['hits_disk']} | {r['gib_moved']:.3f} | {r['mean_move_ms']:.1f} |"
        )
    print("\n| run | steps that loaded | blocks per step | load ms | step ms | load share of the step |")
    print("|---|---|---|---|---|---|")
    for r in rows[1:]:
        share = r["mean_load_ms"] / r["mean_load_step_ms"] if r["mean_load_step_ms"] else 0.0
        print(
            f"| {r['run']} | {r['load_steps']} | {r['blocks_per_load_step']:.1f} | {r['mean_load_ms']:.1f} "
            f"| {r['mean_load_step_ms']:.1f} | {share:.0%} |"
        )
    print(
        f"\nwhat a prefetch thread could take off a loading step: reading and checking {probe['blocks']} blocks of "
        f"{probe['block_bytes'] / 2**10:.0f} KiB from a disk tier file takes {probe['read_ms']:.1f} ms"
    )
    print(f"same greedy tokens in every run: {same}")
    if args.json:
        args.json.write_text(json.dumps({"workload": asdict(w), "rows": rows, "probe": probe, "same": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
