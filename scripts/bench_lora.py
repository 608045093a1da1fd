"""Multi-LoRA serving cost on CPU: decode throughput of a batch whose rows use 1, 4 or 16 adapters (rank 8 and 64,
every projection adapted; rows round-robin over the adapters) against the same batch on the base model, in the
same engine and the same run (base and LoRA batches alternate, the best of the repeats counts, so a machine's
load drifts both alike). A row of "base, LoRA off" is the engine without --enable-lora.

Each configuration gets an engine with --max-loras equal to its adapter count, in a process of its own. The
adapters are random PEFT folders written by this script.

    .venv/bin/python scripts/bench_lora.py [--model default] [--threads N] [--json out.json]
    .venv/bin/python scripts/bench_lora.py --smoke    # what CI runs: a tiny model, tiny batches
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from proto.lora import ATTENTION_MODULES, BaseShapes  # noqa: E402
from scheduler_node.engine.model_path import DEFAULT, resolve_model  # noqa: E402

MODULES = [("self_attn", m) for m in ATTENTION_MODULES] + [("mlp", m) for m in ("gate_proj", "up_proj", "down_proj")]


def write_adapter(folder: Path, base: BaseShapes, rank: int, seed: int) -> Path:
    """A random PEFT adapter of every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for block, module in MODULES:
            inputs, outputs = base.io(module)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{{}}.weight"
            tensors[key.format("A")] = torch.randn(rank, inputs, generator=gen) / inputs**0.5
            tensors[key.format("B")] = torch.randn(outputs, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m for _, m in MODULES]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]) -> float:
    """Output tokens per second of one batch."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def measure(model: Path, adapters: list[Path], count: int, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    requests = [LoRARequest(f"r{rank}-{i}", i + 1, str(a)) for i, a in enumerate(adapters[:count])]
    mixed: list[LoRARequest | None] = [requests[i % count] for i in range(args.batch)]
    base: list[LoRARequest | None] = [None] * args.batch
    with LLM(
        str(model),
        dtype=args.dtype,
        threads=args.threads,
        enable_lora=True,
        max_loras=count,
        max_lora_rank=rank,
        max_num_seqs=args.batch,
        kv_cache_memory=args.kv_cache_memory,
    ) as llm:
        timed(llm, prompts, params, mixed)  # loads the adapters; warms both paths
        timed(llm, prompts, params, base)
        base_best = lora_best = 0.0
        for _ in range(args.repeats):
            base_best = max(base_best, timed(llm, prompts, params, base))
            lora_best = max(lora_best, timed(llm, prompts, params, mixed))
    return {
        "adapters": count,
        "rank": rank,
        "base tok/s": round(base_best, 1),
        "LoRA tok/s": round(lora_best, 1),
        "step time vs base": round(base_best / lora_best, 3),
    }


def lora_off(model: Path, args: argparse.Namespace) -> float:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(
        str(model),
        dtype=args.dtype,
        threads=args.threads,
        max_num_seqs=args.batch,
        kv_cache_memory=args.kv_cache_memory,
    ) as llm:
        best = 0.0
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return round(best, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT, help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--counts", default="1,4,16", help="adapters per batch (and --max-loras)")
    p.add_argument("--batch", type=int, default=16, help="rows of the batch")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="rank 8, 1 and 2 adapters, tiny batches (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.smoke:
        args.ranks, args.counts, args.batch, args.output_len, args.repeats = "8", "1,2", 4, 4, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.model)
    base = BaseShapes.from_folder(model)
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(c) for c in args.counts.split(",")]
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for rank in ranks:
            adapters = [write_adapter(Path(scratch) / f"r{rank}-{i}", base, rank, i) for i in range(max(counts))]
            for count in counts:  # each engine in a process of its own: one's memory does not weigh on the next
                with multiprocessing.get_context("spawn").Pool(1) as pool:
                    rows.append(pool.apply(measure, (model, adapters, count, rank, args)))
                print(rows[-1], flush=True)
    report = {
        "model": model.name,
        "threads": args.threads,
        "batch": args.batch,
        "tokens": f"{args.prompt_len} prompt + {args.output_len} output per row",
        "base, LoRA off tok/s": lora_off(model, args),
        "rows": rows,
        "load": f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
    }
    print(f"## multi-LoRA decode, {model.name}, batch {args.batch}, {args.threads} threads, {args.dtype}")
    print(f"base, LoRA off: {report['base, LoRA off tok/s']} tok/s; load {report['load']}")
    print("| adapters | rank | base tok/s | LoRA tok/s | step time vs base |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
