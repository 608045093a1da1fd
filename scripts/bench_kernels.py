"""Triton attention on a GPU: kernel correctness vs the torch reference, decode bandwidth, prefill FLOP/s, and
end-to-end engine decode tokens/s with the Triton vs the torch attention backend.

    python scripts/bench_kernels.py                  # everything, a few minutes on a recent GPU
    python scripts/bench_kernels.py --sweep          # also try other decode/prefill tile configs
    python scripts/bench_kernels.py --skip-engine    # kernels only
    python scripts/bench_kernels.py --engine-only    # the end-to-end engine comparison only
    python scripts/bench_kernels.py --smoke          # seconds, CPU or GPU: every part at tiny sizes (CI)

Decode attention is memory-bound, so it is judged by the bytes of K/V it reads per second against what a
plain device-to-device copy achieves on the same GPU (bar: 70%). Prefill is judged in TFLOP/s.

The engine comparison runs the offline API `minivllm.LLM` (the engine core with in-process workers) on
SmolLM2-135M in bf16: 64 requests of about 128 prompt tokens, 128 greedy output tokens each (eos ignored), with
the torch backend run eagerly and with the Triton kernels replayed from CUDA graphs. Decode tokens/s is the
time of the whole run less that of a run to the first token, over the tokens in between; each configuration
runs once to compile, capture and warm up first.

`--smoke` runs every part the machine can reach at tiny sizes, so CI (CPU only) notices when the code drifts
from the APIs it calls: the kernel checks at one small shape, and the engine comparison on 2 short requests
with every backend the device has. Without CUDA the Triton kernels run in Triton's interpreter
(`TRITON_INTERPRET=1`; no bf16 there: the interpreter's `tl.dot` multiplies raw bf16 bit patterns), the engine
compares the torch reference, the native C decode kernel and Triton in fp32, and the speed runs (CUDA events)
are skipped with a note. The figures of a smoke run mean nothing; the table's rows and agreement columns do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import torch_attention as ref  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (block_size, head_dim, GQA group) covering every supported value at least once
CHECK_SHAPES = [(16, 128, 1), (32, 64, 2), (64, 128, 4), (16, 64, 8), (32, 128, 8)]
SMOKE_CHECK_SHAPES = [(16, 64, 2)]
# the longest cached sequence and the longest new chunk of the checks: past many blocks, and past a few
LONG_LENS, SMOKE_LONG_LENS = (700, 300), (100, 24)
BANDWIDTH_BAR = 0.70


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="dtype of the speed runs")
    parser.add_argument("--num-kv-heads", type=int, default=8, help="KV heads of the speed runs")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head in the speed runs")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim of the speed runs")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size of the speed runs")
    parser.add_argument("--skip-correctness", action="store_true", help="only time the kernels")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs (slower)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--skip-engine", action="store_true", help="skip the end-to-end engine comparison")
    parser.add_argument("--engine-only", action="store_true", help="only run the end-to-end engine comparison")
    parser.add_argument("--model", type=Path, help="HF model folder of the engine runs (default: SmolLM2-135M)")
    parser.add_argument("--engine-requests", type=int, default=64, help="requests of the engine runs")
    parser.add_argument("--engine-prompt-len", type=int, default=128, help="prompt tokens per engine request")
    parser.add_argument("--engine-output-len", type=int, default=128, help="output tokens per engine request")
    parser.add_argument(
        "--engine-batched-tokens", type=int, default=2048, help="max_num_batched_tokens of the engine runs"
    )
    parser.add_argument("--engine-dtype", default="bfloat16", help="dtype of the engine runs")
    parser.add_argument("--engine-kv-memory", default="16GiB", help="KV cache of the engine runs (a fixed size)")
    parser.add_argument(
        "--cuda-graph-sizes", default="1,2,4,8,16,32,64", help="decode batch sizes captured for the Triton run"
    )
    parser.add_argument("--engine-runs", type=int, default=2, help="timed runs per shape; the best one counts")
    parser.add_argument(
        "--smoke", action="store_true", help="every part the device reaches, at tiny sizes, in seconds (CI; CPU too)"
    )
    return parser


def apply_smoke(args: argparse.Namespace, device: str) -> None:
    """Tiny engine sizes (fp32 on CPU, where Triton's interpreter cannot multiply bf16)."""
    args.engine_requests, args.engine_prompt_len, args.engine_output_len, args.engine_runs = 2, 8, 4, 1
    args.engine_batched_tokens, args.engine_kv_memory, args.cuda_graph_sizes = 64, "64MiB", "1,2"
    if device == "cpu":
        args.engine_dtype = "float32"


def paged_cache(
    lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables scattering each sequence over shuffled blocks."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=device)
    for i, start in enumerate(itertools.accumulate([0] + per_seq[:-1])):
        tables[i, : per_seq[i]] = order[start : start + per_seq[i]]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, seq_lens


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).norm() / want.float().norm())


def check_correctness(
    tri: ModuleType,
    shapes: list[tuple[int, int, int]] = CHECK_SHAPES,
    dtypes: dict[str, torch.dtype] = DTYPES,
    long_lens: tuple[int, int] = LONG_LENS,
    device: str = "cuda",
) -> list[dict]:
    """Each Triton kernel against the torch reference on every (block size, head dim, group) x dtype."""
    rows = []
    long_cached, long_new = long_lens
    for (block_size, head_dim, group), (dname, dtype) in itertools.product(shapes, dtypes.items()):
        kv_heads, scale = 2, head_dim**-0.5
        lens = [1, block_size + 1, 5 * block_size - 3, long_cached]
        k_cache, v_cache, tables, seq_lens = paged_cache(lens, kv_heads, head_dim, block_size, dtype, device)
        errs = {}
        q = torch.randn(len(lens), kv_heads * group, head_dim, device=device, dtype=dtype)
        args = (q, k_cache, v_cache, tables, seq_lens, scale)
        want = ref.paged_decode_attention(*args)
        for segments in (1, 4, None):
            errs[f"decode[seg={segments}]"] = rel_err(tri.paged_decode_attention(*args, num_segments=segments), want)
        new = [1, 9, block_size, long_new]
        cu = torch.tensor([0] + new, device=device).cumsum(0).int()
        qp = torch.randn(sum(new), kv_heads * group, head_dim, device=device, dtype=dtype)
        kp = torch.randn(sum(new), kv_heads, head_dim, device=device, dtype=dtype)
        vp = torch.randn_like(kp)
        pargs = (qp, kp, vp, k_cache, v_cache, tables, cu, seq_lens, scale)
        errs["prefill"] = rel_err(tri.paged_prefill_attention(*pargs), ref.paged_prefill_attention(*pargs))
        slots = torch.randperm(k_cache.shape[0] * block_size, device=device)[: sum(new)]
        want_k, want_v, got_k, got_v = (c.clone() for c in (k_cache, v_cache, k_cache, v_cache))
        ref.write_kv(kp, vp, want_k, want_v, slots)
        tri.write_kv(kp, vp, got_k, got_v, slots)
        errs["write_kv"] = max(rel_err(got_k, want_k), rel_err(got_v, want_v))
        for kernel, err in errs.items():
            ok = err < TOLERANCE[dtype]
            shape = f"bs={block_size} d={head_dim} g={group}"
            rows.append({"kernel": kernel, "dtype": dname, "shape": shape, "rel_err": err, "ok": ok})
    return rows


def copy_bandwidth() -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of 2 GiB."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def bench_decode(tri: ModuleType, args: argparse.Namespace, batch: int, seq_len: int) -> dict:
    from triton.testing import do_bench

    dtype = DTYPES[args.dtype]
    k_cache, v_cache, tables, seq_lens = paged_cache(
        [seq_len] * batch, args.num_kv_heads, args.head_dim, args.block_size, dtype
    )
    q = torch.randn(batch, args.num_kv_heads * args.group, args.head_dim, device="cuda", dtype=dtype)
    ms = do_bench(lambda: tri.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1), return_mode="median")
    kv_bytes = 2 * batch * seq_len * args.num_kv_heads * args.head_dim * k_cache.element_size()
    return {"batch": batch, "seq_len": seq_len, "ms": ms, "GB/s": kv_bytes / (ms * 1e-3) / 1e9}


def bench_prefill(tri: ModuleType, args: argparse.Namespace, num_seqs: int, prefix: int, new: int) -> dict:
    from triton.testing import do_bench

    dtype, kv_heads, head_dim = DTYPES[args.dtype], args.num_kv_heads, args.head_dim
    heads = kv_heads * args.group
    k_cache, v_cache, tables, seq_lens = paged_cache(
        [prefix + new] * num_seqs, kv_heads, head_dim, args.block_size, dtype
    )
    q = torch.randn(num_seqs * new, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(num_seqs * new, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    cu = torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * new
    pargs = (q, k, v, k_cache, v_cache, tables, cu, seq_lens, head_dim**-0.5)
    ms = do_bench(lambda: tri.paged_prefill_attention(*pargs), return_mode="median")
    pairs = num_seqs * (new * prefix + new * (new + 1) // 2)  # (query, visible key) pairs
    flops = 4 * pairs * heads * head_dim  # QK^T and PV, a multiply-add each
    return {"seqs": num_seqs, "prefix": prefix, "new": new, "ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12}


def _try(bench: Callable[[], dict]) -> dict:
    """A sweep config that does not fit the GPU (e.g. shared memory) is reported, not fatal."""
    try:
        return {"ms": float("nan"), **bench(), "error": ""}
    except Exception as exc:  # noqa: BLE001 - triton raises several unrelated types for a bad config
        return {"ms": float("nan"), "error": type(exc).__name__}


def sweep(tri: ModuleType, args: argparse.Namespace) -> list[dict]:
    """Time other tile configs on the main decode and prefill shapes, patching the modules' config pickers."""
    from kernels import triton_decode, triton_prefill

    rows = []
    decode_default, prefill_default = triton_decode._tile_config, triton_prefill._tile_config
    try:
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            triton_decode._tile_config = lambda *_, c=(block_n, warps, stages): c
            config = f"N={block_n} w={warps} s={stages}"
            rows.append({"kernel": "decode", "config": config, **_try(lambda: bench_decode(tri, args, 64, 4096))})
        for bm, bn, warps, stages in [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2)]:
            triton_prefill._tile_config = lambda *_, c=(bm, bn, warps, stages): c
            config = f"M={bm} N={bn} w={warps} s={stages}"
            rows.append({"kernel": "prefill", "config": config, **_try(lambda: bench_prefill(tri, args, 8, 0, 2048))})
    finally:
        triton_decode._tile_config, triton_prefill._tile_config = decode_default, prefill_default
    return rows


WORDS = (
    "the cat sat on a warm mat while rain fell over quiet hills and rivers ran to the sea where ships carry "
    "grain salt iron wool stories songs and letters between distant towns under bright cold stars"
).split()


def engine_prompts(args: argparse.Namespace) -> list[str]:
    """Text prompts of about `--engine-prompt-len` tokens (common words, about a token each), distinct per request."""
    rng = random.Random(0)
    return [
        f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(args.engine_prompt_len))
        for i in range(args.engine_requests)
    ]


def engine_run(
    llm_kwargs: dict[str, Any], prompts: list[str], output_len: int, runs: int = 2
) -> tuple[dict, list[list[int]]]:
    """Decode tokens/s of `minivllm.LLM(**llm_kwargs)` on greedy requests with eos ignored: the time of a run
    to `output_len` tokens less the time of a run to 1 token (prefill and first token) over the tokens between,
    each the best of `runs` after a warm-up of both (the kernels compile and the CUDA graphs capture there)."""
    from minivllm import LLM, SamplingParams

    def timed(llm: Any, max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    with LLM(**llm_kwargs) as llm:
        timed(llm, output_len)  # warm-up of both shapes: kernels compile, graphs capture, allocations settle
        timed(llm, 1)
        first_s = min(timed(llm, 1)[0] for _ in range(runs))
        total_s, outputs = min((timed(llm, output_len) for _ in range(runs)), key=lambda run: run[0])
    if any(len(o) != output_len for o in outputs):
        raise RuntimeError(f"asked for {output_len} tokens each, got {sorted({len(o) for o in outputs})}")
    decode_tokens = len(prompts) * (output_len - 1)
    decode_s = max(total_s - first_s, 1e-9)
    stats = {"total s": total_s, "first-token s": first_s, "decode tok/s": decode_tokens / decode_s}
    return stats, outputs


def cpu_backends() -> tuple[list[tuple[str, str]], list[str]]:
    """(label, attention backend) of each backend a CPU engine can run here beyond the torch reference, and a
    note for each it cannot."""
    from kernels import cpu_attention
    from kernels.backend import interpreter_enabled, triton_available

    backends, missing = [], []
    if cpu_attention.load() is not None:
        backends.append(("native", "native"))
    else:
        missing.append("engine with the native CPU decode kernel: it could not be built (no C compiler?)")
    if triton_available() and interpreter_enabled():
        backends.append(("triton (interpreter)", "triton"))
    else:
        missing.append("engine with Triton on CPU: needs the triton package and TRITON_INTERPRET=1")
    return backends, missing


def engine_configs(args: argparse.Namespace, device: str) -> list[tuple[str, dict[str, Any]]]:
    """The torch backend run eagerly first; then on CUDA the Triton kernels replayed from CUDA graphs, on CPU
    each other backend `cpu_backends` finds (the native C decode kernel, Triton in its interpreter)."""
    model = str(args.model) if args.model else None
    common = dict(model=model, device=device, dtype=args.engine_dtype, max_num_seqs=args.engine_requests)
    common["kv_cache_memory"] = args.engine_kv_memory
    common["max_num_batched_tokens"] = args.engine_batched_tokens
    torch_run = dict(common, attention_backend="torch", cuda_graph_sizes="")
    if device != "cuda":
        return [("torch", torch_run)] + [
            (label, dict(torch_run, attention_backend=b)) for label, b in cpu_backends()[0]
        ]
    triton_run = dict(common, attention_backend="triton", cuda_graph_sizes=args.cuda_graph_sizes)
    return [("torch", torch_run), ("triton + CUDA graphs", triton_run)]


def bench_engine(args: argparse.Namespace, device: str = "cuda") -> list[dict]:
    """Decode tokens/s of the whole engine (through `minivllm.LLM`) with each attention backend."""
    prompts = engine_prompts(args)
    rows, outputs = [], []
    for label, kwargs in engine_configs(args, device):
        stats, got = engine_run(kwargs, prompts, args.engine_output_len, args.engine_runs)
        rows.append({"backend": label, **stats})
        outputs.append(got)
    for row, got in zip(rows, outputs):  # bf16 rounding differs between backends: greedy paths may part late
        row["same as torch"] = f"{sum(a == b for a, b in zip(got, outputs[0]))}/{len(prompts)}"
        row["speed-up"] = row["decode tok/s"] / rows[0]["decode tok/s"]
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(dict.fromkeys(c for r in rows for c in r))  # every key, in first-seen order
    cells = [[f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(f"\n## {title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def correctness_plan(
    smoke: bool, device: str
) -> tuple[list[tuple[int, int, int]], dict[str, torch.dtype], tuple[int, int]]:
    """Shapes, dtypes and longest lengths of the correctness checks: one small shape in a smoke run, and no bf16
    in Triton's interpreter (its `tl.dot` multiplies raw bf16 bit patterns)."""
    if not smoke:
        return CHECK_SHAPES, DTYPES, LONG_LENS
    dtypes = {name: dtype for name, dtype in DTYPES.items() if device == "cuda" or dtype != torch.bfloat16}
    return SMOKE_CHECK_SHAPES, dtypes, SMOKE_LONG_LENS


def kernel_benchmarks(tri: ModuleType, args: argparse.Namespace, results: dict[str, Any], device: str = "cuda") -> bool:
    """Correctness, then on CUDA decode bandwidth, prefill FLOP/s (and the sweep); False if a check failed."""
    ok = True
    if not args.skip_correctness:
        checks = check_correctness(tri, *correctness_plan(args.smoke, device), device=device)
        print_table(f"correctness vs torch reference ({device})", checks)
        ok = all(row["ok"] for row in checks)
        results["correctness"] = checks
    if device != "cuda":
        return ok
    copy_bw = copy_bandwidth() / 1e9
    decode = [bench_decode(tri, args, b, n) for b, n in [(1, 32768), (8, 8192), (64, 4096), (256, 1024)]]
    for row in decode:
        row["% of copy"] = 100 * row["GB/s"] / copy_bw
    best = max(row["% of copy"] for row in decode)
    print_table(f"decode attention ({args.dtype}); device copy = {copy_bw:.0f} GB/s", decode)
    print(f"best decode bandwidth: {best:.1f}% of copy (bar {100 * BANDWIDTH_BAR:.0f}%)")
    prefill = [bench_prefill(tri, args, s, p, n) for s, p, n in [(8, 0, 2048), (4, 4096, 512), (64, 0, 256)]]
    print_table(f"prefill attention ({args.dtype})", prefill)
    results.update(copy_GBps=copy_bw, decode=decode, prefill=prefill, decode_bar_met=best >= 100 * BANDWIDTH_BAR)
    if args.sweep:
        results["sweep"] = sweep(tri, args)
        print_table("tile-config sweep", results["sweep"])
    return ok


def triton_kernels(device: str) -> ModuleType | str:
    """The Triton kernels module, or why it cannot run here."""
    from kernels.backend import interpreter_enabled

    if device == "cpu" and not interpreter_enabled():
        return "the Triton kernels run on CPU only in Triton's interpreter (TRITON_INTERPRET=1)"
    try:
        from kernels import triton_attention
    except ImportError as exc:
        return f"cannot import the Triton kernels ({exc}); pip install triton"
    return triton_attention


def skipped_on(device: str, args: argparse.Namespace, tri: ModuleType | str) -> list[str]:
    """A note for each part of the run this device cannot reach (CPU: a smoke run reaches what it can)."""
    if device == "cuda":
        return []
    notes = [] if args.engine_only else ["decode/prefill speed runs and the sweep: they time CUDA events"]
    if isinstance(tri, str) and not args.engine_only and not args.skip_correctness:
        notes.append(f"kernel correctness: {tri}")
    return notes + ([] if args.skip_engine else cpu_backends()[1])


def main() -> int:
    args = build_parser().parse_args()
    if args.skip_engine and args.engine_only:
        print("bench_kernels: --skip-engine and --engine-only leave nothing to run", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench_kernels: no CUDA device; --smoke runs what a CPU reaches, at tiny sizes", file=sys.stderr)
        return 2
    if args.smoke:
        apply_smoke(args, device)
    if device == "cpu":  # Triton's interpreter, set before any kernel module decorates its kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tri = triton_kernels(device)
    if isinstance(tri, str) and device == "cuda":
        print(f"bench_kernels: {tri}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    results["skipped"] = skipped_on(device, args, tri)
    ok = True
    if not args.engine_only and not isinstance(tri, str):
        ok = kernel_benchmarks(tri, args, results, device)
        torch.cuda.empty_cache()
    if not args.skip_engine:
        results["engine"] = bench_engine(args, device)
        shape = f"{args.engine_requests} x ({args.engine_prompt_len} prompt + {args.engine_output_len} output)"
        print_table(f"engine decode on {device}, {shape} tokens, {args.engine_dtype}", results["engine"])
    for note in results["skipped"]:
        print(f"skipped on {device}: {note}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
