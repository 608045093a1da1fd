"""The CPU operations behind the dtype choice, in float32 and bf16: the linear layers of one decoder layer
(fused QKV, O, fused gate/up, down) and the LM head for a range of row counts (tokens in a step), and the native
decode-attention kernel over a float32 and a bf16 cache.

    .venv/bin/python scripts/bench_cpu_dtypes.py              # SmolLM2-135M's shapes, 1 to 512 rows
    .venv/bin/python scripts/bench_cpu_dtypes.py --threads 1 --rows 1,16,64
    .venv/bin/python scripts/bench_cpu_dtypes.py --smoke      # what CI runs

Each figure is the fastest of --repeats runs (the machine is shared: the fastest is the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kernels import cpu_attention, torch_attention  # noqa: E402
from worker_node.models.config import ModelConfig  # noqa: E402


def fastest_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of each linear layer of one decoder layer, fused as the model runs them."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    return [(qkv, h), (h, config.num_heads * d), (2 * config.intermediate_size, h), (h, config.intermediate_size)]


def measure(config: ModelConfig, rows: int, dtype: torch.dtype, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * 0.02).to(dtype) for o, i in layer_shapes(config)]
    inputs = [torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights]
    head = (torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.02).to(dtype)

    def layer() -> None:
        for x, w in zip(inputs, weights):
            F.linear(x, w)

    layer_ms = fastest_ms(layer, repeats)
    head_ms = fastest_ms(lambda: F.linear(inputs[0], head), max(2, repeats // 4))
    flops = 2 * rows * sum(w.numel() for w in weights)
    return {"rows": rows, "layer_ms": layer_ms, "layer_GFLOPs": flops / layer_ms / 1e6, "head_ms": head_ms}


def measure_decode(config: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype, repeats: int) -> float:
    """ms of one layer's decode attention for `batch` sequences of `seq_len` cached tokens, blocks shuffled."""
    block_size, gen = 16, torch.Generator().manual_seed(1)
    per_seq = -(-seq_len // block_size)
    shape = (batch * per_seq, block_size, config.num_kv_heads, config.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).int()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    q = torch.randn(batch, config.num_heads, config.head_dim, generator=gen).to(dtype)
    native = cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention)
    return fastest_ms(lambda: native(q, k_cache, v_cache, tables, seq_lens, config.head_dim**-0.5), repeats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder whose shapes to use, or 'default' (SmolLM2-135M)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512", help="tokens per step, comma-separated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--repeats", type=int, default=30, help="runs per figure (the fastest counts)")
    p.add_argument("--smoke", action="store_true", help="two row counts, few repeats (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    if args.smoke:
        args.rows, args.repeats = "1,16", 3
    from scheduler_node.engine.model_path import resolve_model

    config = ModelConfig.from_folder(resolve_model(args.model))
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; one decoder layer's linears, then the LM head ({config.vocab_size} rows)")
    columns = ["rows", "fp32 layer ms", "bf16 layer ms", "fp32 / bf16", "fp32 GFLOP/s", "bf16 GFLOP/s"]
    columns += ["fp32 head ms", "bf16 head ms"]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        f32, b16 = (measure(config, rows, dtype, args.repeats) for dtype in (torch.float32, torch.bfloat16))
        table.append({"rows": rows, "float32": f32, "bfloat16": b16})
        print(
            f"| {rows} | {f32['layer_ms']:.3f} | {b16['layer_ms']:.3f} | {f32['layer_ms'] / b16['layer_ms']:.2f}x "
            f"| {f32['layer_GFLOPs']:.0f} | {b16['layer_GFLOPs']:.0f} | {f32['head_ms']:.2f} | {b16['head_ms']:.2f} |",
            flush=True,
        )
    print("\n| decode attention, one layer | fp32 cache ms | bf16 cache ms | fp32 / bf16 |\n|---|---|---|---|")
    attention = []
    for batch, seq_len in ((4, 400), (64, 400)) if not args.smoke else ((2, 40),):
        f32_ms, b16_ms = (
            measure_decode(config, batch, seq_len, d, args.repeats) for d in (torch.float32, torch.bfloat16)
        )
        attention.append({"batch": batch, "seq_len": seq_len, "float32_ms": f32_ms, "bfloat16_ms": b16_ms})
        print(f"| {batch} x {seq_len} tokens | {f32_ms:.3f} | {b16_ms:.3f} | {f32_ms / b16_ms:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "table": table, "attention": attention}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
