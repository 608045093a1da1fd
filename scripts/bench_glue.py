"""A decoder layer's glue at decode sizes: torch's ops vs kernels/cpu_glue.py's fused kernels, per layer.

The glue is what a Llama layer does besides its four projections and attention: the previous layer's MLP output
added to the residual and RMSNorm before attention, rotary on q and k, the residual add and RMSNorm before the
MLP, silu(gate) * up. Both paths run
on the same inputs (SmolLM2-135M's shapes by default); figures are the calling thread's CPU microseconds per
layer (`time.thread_time`: steadier than wall time on a shared machine), the best of --repeats rounds of
--iters calls, the two paths alternated within each round.

    .venv/bin/python scripts/bench_glue.py                        # 16 and 64 rows, float32 and bfloat16
    .venv/bin/python scripts/bench_glue.py --smoke                # what CI runs: a few calls
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_glue  # noqa: E402
from worker_node.models.layers import apply_rope  # noqa: E402

Results = tuple[torch.Tensor, ...]  # the residual, the normed rows, silu(gate) * up, q, k
Glue = Callable[[], Results]


class LayerInputs:
    """What the glue of one layer reads: the residual stream, the projections' outputs, norm weights, angles."""

    def __init__(self, args: argparse.Namespace, rows: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(rows)
        h, d = args.hidden, args.head_dim
        self.heads, self.kv_heads, self.head_dim = args.heads, args.kv_heads, d

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        self.x, self.attn_out, self.mlp_out = randn(rows, h), randn(rows, h), randn(rows, h)  # mlp_out: the last
        # layer's
        self.norm1, self.norm2 = randn(h), randn(h)
        self.qkv = randn(rows, (args.heads + 2 * args.kv_heads) * d)
        self.gate_up = randn(rows, 2 * args.intermediate)
        freqs = torch.rand(rows, d // 2, generator=gen) * 100
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)

    def qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, _ = self.qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(-1, self.heads, self.head_dim), k.view(-1, self.kv_heads, self.head_dim)


def torch_glue(inputs: LayerInputs, eps: float = 1e-5) -> Results:
    """The layer's glue as torch ops (the path before the fused kernels, and the fallback)."""
    x = inputs.x + inputs.mlp_out
    h = F.rms_norm(x, (x.shape[-1],), inputs.norm1, eps)
    q, k = inputs.qk()
    q, k = apply_rope(q, (inputs.cos, inputs.sin)), apply_rope(k, (inputs.cos, inputs.sin))
    x = x + inputs.attn_out
    h = F.rms_norm(x, (x.shape[-1],), inputs.norm2, eps)
    gate, up = inputs.gate_up.split(inputs.gate_up.shape[-1] // 2, dim=-1)
    act = F.silu(gate) * up
    return x, h, act, q, k


def fused_glue(inputs: LayerInputs, eps: float = 1e-5) -> Results:
    """The same glue through kernels/cpu_glue.py, as the layers now call it."""
    h, x = cpu_glue.rms_norm(inputs.x, inputs.norm1, eps, delta=inputs.mlp_out)
    q, k = inputs.qk()
    if not cpu_glue.rotary_(q, k, inputs.cos, inputs.sin):
        raise RuntimeError("the rotary kernel declined the benchmark's inputs")
    h, x = cpu_glue.rms_norm(x, inputs.norm2, eps, delta=inputs.attn_out)
    act = cpu_glue.silu_mul(inputs.gate_up)
    return x, h, act, q, k


def cpu_us(glue: Glue, iters: int) -> float:
    start = time.thread_time()
    for _ in range(iters):
        glue()
    return (time.thread_time() - start) / iters * 1e6


def agree(args: argparse.Namespace, rows: int, dtype: torch.dtype) -> bool:
    """The two paths' results on fresh inputs (the fused rotary rotates q and k in place), within bf16 rounding."""
    inputs = LayerInputs(args, rows, dtype)
    pairs = zip(fused_glue(inputs), torch_glue(LayerInputs(args, rows, dtype)))
    return all(torch.allclose(got.float(), want.float(), atol=5e-2, rtol=2e-2) for got, want in pairs)


def measure(args: argparse.Namespace, rows: int, dtype: torch.dtype) -> tuple[float, float]:
    inputs = LayerInputs(args, rows, dtype)
    paths = (lambda: torch_glue(inputs), lambda: fused_glue(inputs))
    best = [float("inf"), float("inf")]
    for glue in paths:
        glue()  # builds the kernel, warms the allocator
    for _ in range(args.repeats):
        for i, glue in enumerate(paths):
            best[i] = min(best[i], cpu_us(glue, args.iters))
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64", help="decode rows (sequences), comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--smoke", action="store_true", help="a few calls: checks the script (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.repeats, args.rows = 3, 1, "3"
    torch.set_num_threads(args.threads)
    if not all(cpu_glue.load(getattr(torch, name)) is not None for name in args.dtypes.split(",")):
        raise SystemExit("the glue kernel could not be built here (see the warning above)")
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.2f}; thread CPU us per layer, best of {args.repeats}")
    print(f"{'dtype':>9} {'rows':>5} {'torch':>9} {'fused':>9} {'speed-up':>9} {'agree':>6}")
    for name in args.dtypes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            same = agree(args, rows, getattr(torch, name))
            before, after = measure(args, rows, getattr(torch, name))
            print(f"{name:>9} {rows:>5} {before:>9.1f} {after:>9.1f} {before / after:>8.2f}x {str(same):>6}")


if __name__ == "__main__":
    main()
