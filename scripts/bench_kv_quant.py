"""A quantized KV cache (--kv-cache-dtype int8 | fp8_e4m3) against full precision, in one run, on CPU:

(a) capacity: KV blocks per GiB for SmolLM2-135M's shape (block 16) in float32, bfloat16, int8 and fp8 e4m3,
    with one scale per token and KV head (what the cache stores) and, beside it, what per-block scales would give;
(b) fidelity: float32 models over int8 / fp8 caches, each greedy token scored by HF's float32 model on the same
    prefix (minivllm/kv_agreement.py): top-1 agreement, the worst logprob gap, the mean |logprob error| of the chosen
    tokens; on the tiny random model of every architecture and on SmolLM2. Yardsticks: a float32 cache (must agree
    everywhere), and a bfloat16 model with its bfloat16 cache (the default on GPUs and bf16 CPUs);
(c) scale granularity: the same with one scale per block and KV head instead, for a block that is written over
    several steps either fixed by its first write (later tokens saturate) or re-quantized whenever new tokens
    exceed its range (emulated in the per-token layout by this script's backends: every slot of a block holds
    the block's scale);
(d) speed: one layer's decode attention in the C CPU kernel over each cache, at SmolLM2's shape.

    .venv/bin/python scripts/bench_kv_quant.py [--threads N] [--json out.json]
    .venv/bin/python scripts/bench_kv_quant.py --smoke    # what CI runs: one tiny model, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_cpu_dtypes import fastest_ms  # noqa: E402

from kernels import cpu_attention, torch_attention  # noqa: E402
from kernels.kv_quant import (  # noqa: E402
    FORMATS,
    MIN_ABSMAX,
    QMAX,
    SCALE_BYTES,
    as_bytes,
    dequantize,
    quantize,
    quantize_with,
)
from minivllm.kv_agreement import Agreement, quantized_agreement  # noqa: E402
from minivllm.tiny_models import TINY_KINDS, build_tiny_model  # noqa: E402
from worker_node.kv.cache import bytes_per_block  # noqa: E402
from worker_node.models.config import ModelConfig  # noqa: E402

GIB = 2**30
BLOCK = 16
QUANTIZED = tuple(FORMATS)  # int8, fp8_e4m3
# Natural text for SmolLM2 (a real model attends to real structure); the tiny random models get random ids.
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three laws of thermodynamics state that",
    "To make a good cup of tea, you first need to",
    "In 1969, the Apollo 11 mission",
    "The mitochondria is often called the powerhouse of the cell because",
    "Here is a list of the largest cities in Europe:\n1.",
]


# ---- (c) per-block scales, emulated: user backends (--attention-backend module:Class) of this script


def _write_block_scaled(
    rows: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, requantize: bool
) -> None:
    """Rows into their slots with one scale per block and head: a block's first write sets it from what that
    write puts in the block; later writes saturate at it, or (`requantize`) grow it and re-round what the block
    already holds. Every slot of the block gets the block's scale, so the per-token readers read it unchanged."""
    block_size, dtype = cache.shape[1], cache.dtype
    values = as_bytes(cache).view(-1, *cache.shape[2:])
    slot_scales = scales.view(-1, scales.shape[2])
    blocks = slots // block_size
    for block in blocks.unique().tolist():
        mine = blocks == block
        new_slots, new_rows = slots[mine], rows[mine].float()
        first = block * block_size
        held = int(new_slots.min()) - first  # tokens the block holds from earlier steps (writes append)
        scale = new_rows.abs().amax(dim=(0, 2)).clamp_min(MIN_ABSMAX) / QMAX[dtype]  # [H]
        if held:
            old_scale = slot_scales[first].clone()
            if requantize and bool((scale > old_scale).any()):
                scale = torch.maximum(scale, old_scale)
                old = dequantize(values[first : first + held].view(dtype), slot_scales[first : first + held])
                values[first : first + held] = as_bytes(quantize_with(old, scale.expand(held, -1), dtype))
            else:
                scale = old_scale
        values[new_slots] = as_bytes(quantize_with(new_rows, scale.expand(len(new_rows), -1), dtype))
        slot_scales[first : first + block_size] = scale


class BlockScalesFixedByFirstWrite:
    """The CPU backend (native decode, torch prefill) with per-block scales fixed by each block's first write."""

    requantize = False

    def __init__(self) -> None:
        self.decode_attention = cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention)
        self.prefill_attention = torch_attention.paged_prefill_attention

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        if k_scales is None or v_scales is None:
            raise ValueError("per-block scales need a quantized cache (--kv-cache-dtype int8 or fp8_e4m3)")
        _write_block_scaled(key, k_cache, k_scales, slot_mapping, self.requantize)
        _write_block_scaled(value, v_cache, v_scales, slot_mapping, self.requantize)


class BlockScalesRequantized(BlockScalesFixedByFirstWrite):
    """Per-block scales that grow when new tokens exceed them, re-rounding what the block holds."""

    requantize = True


SCHEMES = {  # scale granularity -> the attention backend that writes it
    "per token": "auto",
    "per block, first write": "bench_kv_quant:BlockScalesFixedByFirstWrite",
    "per block, re-quantized": "bench_kv_quant:BlockScalesRequantized",
}


# ---- (a) capacity


def capacity(config: ModelConfig) -> list[dict[str, Any]]:
    """Blocks per GiB for each cache format; int8/fp8 also with one scale per block and head instead of per token."""
    rows: list[dict[str, Any]] = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), *FORMATS.items()):
        rows.append({"cache": name, "bytes_per_block": bytes_per_block(config, BLOCK, dtype)})
    per_block_scales = 2 * config.num_layers * config.num_kv_heads * (BLOCK * config.head_dim + SCALE_BYTES)
    rows.append({"cache": "int8/fp8, per-block scales", "bytes_per_block": per_block_scales})
    fp32, bf16 = rows[0]["bytes_per_block"], rows[1]["bytes_per_block"]
    for row in rows:
        row |= {"blocks_per_gib": GIB // row["bytes_per_block"]}
        row |= {"vs_float32": fp32 / row["bytes_per_block"], "vs_bfloat16": bf16 / row["bytes_per_block"]}
    return rows


# ---- (b), (c) fidelity


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def workloads(smoke: bool, scratch: Path) -> list[tuple[str, Path, list[list[int]], list[int]]]:
    """(model name, folder, prompts, max tokens): the tiny model of each architecture, and SmolLM2."""
    from scheduler_node.text.tokenizer import ModelTokenizer
    from worker_node.default_model import ensure_default_model

    smollm2 = ensure_default_model()
    if smoke:
        return [("tiny llama", build_tiny_model("llama", scratch / "llama", smollm2), random_prompts(0, [17]), [8])]
    lengths, max_tokens = [5, 17, 40] * 3, [24, 12, 30] * 3
    out = []
    for kind in TINY_KINDS:
        prompts = random_prompts(1, lengths)
        out.append((f"tiny {kind}", build_tiny_model(kind, scratch / kind, smollm2), prompts, max_tokens))
    tokenizer = ModelTokenizer(smollm2)
    out.append(("SmolLM2-135M", smollm2, [tokenizer.encode(t) for t in TEXTS], [48] * len(TEXTS)))
    return out


def fidelity_row(model: str, cache: str, a: Agreement, **extra: str) -> dict:
    return {"model": model, "cache": cache, **extra, **asdict(a), "rate": a.rate}


def fidelity(work: list[tuple[str, Path, list[list[int]], list[int]]]) -> tuple[list[dict], list[dict]]:
    """(b)'s rows (per model and cache) and (c)'s (per model, format and scale granularity)."""
    rows, granularity = [], []
    for model, folder, prompts, max_tokens in work:
        runs = {
            "float32": quantized_agreement(folder, "auto", prompts, max_tokens),
            "bf16 model + cache": quantized_agreement(folder, "auto", prompts, max_tokens, dtype="bfloat16"),
        }
        for fmt in QUANTIZED:
            for scheme, backend in SCHEMES.items():
                a = quantized_agreement(folder, fmt, prompts, max_tokens, backend=backend)
                granularity.append(fidelity_row(model, fmt, a, scales=scheme))
                if scheme == "per token":
                    runs[fmt] = a
        for cache, a in runs.items():
            rows.append(fidelity_row(model, cache, a))
            print_row(rows[-1], ["model", "cache"])
    return rows, granularity


def totals(rows: list[dict], keys: list[str], tiny_only: bool) -> list[dict]:
    """Rows summed over models (all, or the tiny ones only), per combination of `keys`."""
    groups: dict[tuple, Agreement] = {}
    for r in rows:
        if tiny_only and not r["model"].startswith("tiny"):
            continue
        a = Agreement(r["tokens"], r["agreeing"], r["worst_gap"], r["mean_logprob_error"])
        key = tuple(r[k] for k in keys)
        groups[key] = groups[key] + a if key in groups else a
    name = "all tiny models" if tiny_only else "all models"
    return [fidelity_row(name, key[0], a, **dict(zip(keys[1:], key[1:]))) for key, a in groups.items()]


def print_row(r: dict, keys: list[str]) -> None:
    cells = [str(r[k]) for k in keys]
    cells += [f"{r['agreeing']}/{r['tokens']} = {100 * r['rate']:.1f} %", f"{r['worst_gap']:.3f}"]
    print("| " + " | ".join(cells + [f"{r['mean_logprob_error']:.2e}"]) + " |", flush=True)


# ---- (d) speed


def decode_ms(config: ModelConfig, batch: int, seq_len: int, cache: str, repeats: int) -> float:
    """ms of one layer's decode attention in the C kernel for `batch` sequences of `seq_len` cached tokens."""
    gen = torch.Generator().manual_seed(1)
    per_seq = -(-seq_len // BLOCK)
    shape = (batch * per_seq, BLOCK, config.num_kv_heads, config.head_dim)
    k, v = (torch.randn(shape, generator=gen) for _ in range(2))
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    if cache in FORMATS:
        (k, k_scales), (v, v_scales) = quantize(k, FORMATS[cache]), quantize(v, FORMATS[cache])
    else:
        k, v = k.to(getattr(torch, cache)), v.to(getattr(torch, cache))
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).int()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    q = torch.randn(batch, config.num_heads, config.head_dim, generator=gen)
    native = cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention)
    scale = config.head_dim**-0.5
    return fastest_ms(lambda: native(q, k, v, tables, seq_lens, scale, k_scales=k_scales, v_scales=v_scales), repeats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--repeats", type=int, default=30, help="runs per decode-attention figure (the fastest counts)")
    p.add_argument("--smoke", action="store_true", help="one tiny model, tiny shapes, few repeats (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.repeats = 3
    from worker_node.default_model import ensure_default_model

    config = ModelConfig.from_folder(ensure_default_model())
    report: dict = {"threads": args.threads, "smoke": args.smoke}

    print(f"(a) KV blocks of {BLOCK} tokens per GiB, SmolLM2-135M's shape ({config.num_layers} layers, "
          f"{config.num_kv_heads} KV heads of {config.head_dim})")  # fmt: skip
    print("| cache | bytes per block | blocks per GiB | vs float32 | vs bfloat16 |\n|---|---|---|---|---|")
    report["capacity"] = capacity(config)
    for r in report["capacity"]:
        print(f"| {r['cache']} | {r['bytes_per_block']} | {r['blocks_per_gib']} | {r['vs_float32']:.2f}x "
              f"| {r['vs_bfloat16']:.2f}x |")  # fmt: skip

    print("\n(b) teacher-forced against HF float32: float32 models over each cache (and a bf16 model, bf16 cache)")
    print("| model | cache | top-1 agreement | worst gap | mean abs logprob error |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        rows, granularity = fidelity(workloads(args.smoke, Path(scratch)))
    report["fidelity"] = rows + totals(rows, ["cache"], True) + totals(rows, ["cache"], False)
    for r in report["fidelity"][len(rows) :]:
        print_row(r, ["model", "cache"])

    print("\n(c) scale granularity, all models together")
    print("| model | cache | scales | top-1 agreement | worst gap | mean abs logprob error |")
    print("|---|---|---|---|---|---|")
    report["granularity"] = granularity + totals(granularity, ["cache", "scales"], False)
    for r in report["granularity"][len(granularity) :]:
        print_row(r, ["model", "cache", "scales"])

    print(f"\n(d) one layer's decode attention, C kernel, {args.threads} threads: ms (and float32 / it)")
    print("| batch x cached tokens | float32 | bfloat16 | int8 | fp8_e4m3 |\n|---|---|---|---|---|")
    report["decode"] = []
    for batch, seq_len in ((2, 40),) if args.smoke else ((4, 400), (64, 400)):
        ms = {c: decode_ms(config, batch, seq_len, c, args.repeats) for c in ("float32", "bfloat16", *QUANTIZED)}
        report["decode"].append({"batch": batch, "seq_len": seq_len, "ms": ms})
        cells = [f"{t:.3f} ({ms['float32'] / t:.2f}x)" for t in ms.values()]
        print(f"| {batch} x {seq_len} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
