"""The quantization part of the GPU check (scripts/gpu_check.py, issue 28): quantized weights on a GPU.

- kernels: each format's layer (worker_node/models/quant_*.py: AWQ and int8 through kernels/triton_quant_gemm.py,
  fp8 through `torch._scaled_mm` with activations quantized per row) against the same weights dequantized and
  multiplied in float64, ||out - ref|| / ||ref||, in bf16, fp16 and fp32 at SmolLM2's projection shapes and a
  Llama-3-8B MLP's; then at the 8B shapes the time of one product (median of CUDA-graph replays over three copies
  of the weight, so no copy stays in the L2) against bf16's torch matmul, and the weight bytes read per second;
- engine: SmolLM2's shape (or `--model`) in bf16 through `minivllm.LLM` with the Triton attention kernels, per
  format (`none`, int8 and fp8 quantized on load, AWQ from a checkpoint written in AutoAWQ's layout by plain
  rounding, group 64): whether the decode CUDA graphs were captured and replayed, the greedy tokens from the graphs
  against the same engine without graphs (the same kernels: they should agree), the tokens against bf16's, and
  decode tokens/s (a run to `output_len` tokens less a run to one token) at each batch size.

`dry_run_config` runs the same code on the CPU at a tiny size (the layers' CPU kernels; no graphs there).
`python scripts/gpu_quant.py --sweep` (a GPU) times the Triton GEMMs' candidate tiles and K splits at the 8B
shapes against bf16: how `kernels/triton_quant_gemm.py`'s `tiles()` was chosen.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMATS = ("none", "int8", "fp8", "awq")
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}  # relative error of the weight-only formats
FP8_TOLERANCE = 0.06  # e4m3 activations: 3 mantissa bits, about 3.6 % per element before the sums average it


@dataclass(frozen=True, slots=True)
class QuantCheckConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    check_dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    check_rows: tuple[int, ...] = (1, 16, 64, 256)
    # (name, in, out): SmolLM2's fused gate/up and its down projection, a Llama-3-8B MLP's two
    shapes: tuple[tuple[str, int, int], ...] = (
        ("SmolLM2 gate/up", 576, 3072),
        ("SmolLM2 down", 1536, 576),
        ("8B gate/up", 4096, 28672),
        ("8B down", 14336, 4096),
    )
    timed_shapes: tuple[str, ...] = ("8B gate/up", "8B down")
    awq_group: int = 64  # SmolLM2's 576-wide inputs do not split into groups of 128
    seqs: tuple[int, ...] = (1, 64)
    prompt_len: int = 64
    output_len: int = 64
    runs: int = 2
    kv_memory: str = "8GiB"
    attention_backend: str = "triton"
    cuda_graph_sizes: str = "1,2,4,8,16,32,64"


def dry_run_config() -> QuantCheckConfig:
    """The same code on the CPU: one small shape, 2 rows, float32, 2 sequences of 3 tokens, no graphs."""
    return QuantCheckConfig(
        "cpu", "float32", ("float32",), (2,), (("small", 128, 64),), (), 32, (2,), 8, 3, 1, "64MiB", "torch", ""
    )


def quant_part(model: str | None, config: QuantCheckConfig) -> dict[str, Any]:
    from worker_node.default_model import ensure_default_model

    folder = model or str(ensure_default_model())
    result: dict[str, Any] = {"model": folder, "config": dataclasses.asdict(config)}
    result["kernels"] = kernel_checks(config)
    result["timings"] = kernel_timings(config)
    with tempfile.TemporaryDirectory(prefix="gpu-quant-") as root:
        result["engine"] = engine_checks(folder, Path(root), config)
    return result


def make_layer(fmt: str, weight: torch.Tensor, config: QuantCheckConfig, dtype: torch.dtype) -> Any:
    """`weight` [out, in] (float32, on the device) as a layer of format `fmt` in `dtype`, ready for its kernel
    (`none`: a plain linear)."""
    from torch import nn

    from worker_node.models.awq_convert import awq_tensors
    from worker_node.models.quant_awq import AwqMethod
    from worker_node.models.quant_linear import QuantLinear
    from worker_node.models.quantize import METHODS

    device = torch.device(config.device)
    if fmt == "none":
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight.to(device, dtype)
        return linear
    if fmt == "awq":
        n, k = weight.shape
        layer = QuantLinear(AwqMethod(config.awq_group), awq_tensors(weight, config.awq_group), n, k)
    else:
        layer = QuantLinear.quantized(METHODS[fmt](), weight)
    layer.to(device)
    layer.cast(dtype)
    layer.method.after_load(layer)
    return layer


def reference(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The layer's product in float64 on the weight it stands for."""
    w = layer.weight if isinstance(layer, torch.nn.Linear) else layer.dequantize()
    return x.double() @ w.double().t()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


def kernel_checks(config: QuantCheckConfig) -> list[dict[str, Any]]:
    """Each format's layer against its float64 reference, every shape, activation dtype and row count."""
    rows = []
    torch.manual_seed(0)
    for name, k, n in config.shapes:
        weight = torch.randn(n, k, device=config.device) * 0.02  # quantized where it runs: the 8B shapes are large
        for dtype_name in config.check_dtypes:
            dtype = getattr(torch, dtype_name)
            for fmt in FORMATS[1:]:
                layer = make_layer(fmt, weight, config, dtype)
                worst = 0.0
                for m in config.check_rows:
                    x = torch.randn(m, k, device=config.device).to(dtype)
                    out = layer(x)
                    error = relative_error(out.float(), reference(layer, x)) if out.dtype == dtype else float("inf")
                    worst = max(worst, error)
                tolerance = FP8_TOLERANCE if fmt == "fp8" else TOLERANCE[dtype_name]
                rows.append(
                    {"shape": name, "dtype": dtype_name, "format": fmt, "rel err": worst, "ok": worst <= tolerance}
                )
                print(f"check {name:16} {dtype_name:9} {fmt:5} rel err {worst:.2e} ok={worst <= tolerance}", flush=True)
                del layer
    return rows


def kernel_timings(config: QuantCheckConfig) -> list[dict[str, Any]]:
    """Microseconds of one product per format and row count at the timed shapes, and weight GB/s read."""
    from worker_node.models.quantize import weight_bytes

    if config.device != "cuda":
        return []
    rows: list[dict[str, Any]] = []
    dtype = getattr(torch, config.dtype)
    for name, k, n in config.shapes:
        if name not in config.timed_shapes:
            continue
        weights = [torch.randn(n, k, device=config.device) * 0.02 for _ in range(3)]
        for fmt in FORMATS:
            layers = [make_layer(fmt, w, config, dtype) for w in weights]
            held = weight_bytes(layers[0])
            for m in config.check_rows:
                x = torch.randn(m, k, device=config.device, dtype=dtype)
                us = graph_time(lambda i, layers=layers, x=x: layers[i % 3](x)) * 1e6
                row = {"shape": name, "format": fmt, "rows": m, "us": us, "weight GB/s": held / us / 1e3}
                rows.append(row)
                print(f"time {name:12} {fmt:5} {m:4} rows {us:9.1f} us {held / us / 1e3:7.0f} GB/s", flush=True)
            torch.cuda.empty_cache()
    for row in rows:
        base = next(
            r for r in rows if r["shape"] == row["shape"] and r["rows"] == row["rows"] and r["format"] == "none"
        )
        row["vs bf16"] = base["us"] / row["us"]
    return rows


def graph_time(call: Any, calls: int = 30, replays: int = 10) -> float:
    """Seconds per call: `calls` calls (call(i)) captured in one CUDA graph, the median of `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for i in range(3):  # warm-up: compilation and lazily made tensors stay out of the graph
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def engine_checks(folder: str, root: Path, config: QuantCheckConfig) -> list[dict[str, Any]]:
    """Per format: graphs captured and replayed, tokens graphs vs eager and vs bf16, decode tok/s per batch size."""
    awq = rounded_awq_folder(Path(folder), root / "awq", config.awq_group)
    prompts = [[3 + (i * 7919 + j * 104729) % 4000 for j in range(config.prompt_len)] for i in range(max(config.seqs))]
    rows, bf16_tokens = [], None
    for fmt in FORMATS:
        model, quantization = (str(awq), "auto") if fmt == "awq" else (folder, "auto" if fmt == "none" else fmt)
        row: dict[str, Any] = {"format": fmt}
        try:
            row |= engine_format(model, quantization, config, prompts)
        except Exception as exc:  # noqa: BLE001 - one format's failure must not cost the others' rows
            row["error"] = f"{type(exc).__name__}: {exc}"
        tokens = row.pop("tokens", None)
        if fmt == "none":
            bf16_tokens = tokens
        elif tokens is not None and bf16_tokens is not None:
            row["same as bf16"] = f"{sum(a == b for a, b in zip(tokens, bf16_tokens))}/{len(tokens)}"
            row["first token as bf16"] = f"{sum(a[:1] == b[:1] for a, b in zip(tokens, bf16_tokens))}/{len(tokens)}"
        print(f"engine {row}", flush=True)
        rows.append(row)
    return rows


def rounded_awq_folder(source: Path, folder: Path, group: int) -> Path:
    """`source` (an HF safetensors folder) with every projection rounded to 4 bits (no activation-aware search: the
    weights here are random) and written in AutoAWQ's GEMM layout into `folder`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from worker_node.models.awq_convert import awq_tensors
    from worker_node.models.quantize import CHECKPOINT_LINEARS

    shutil.copytree(source, folder)
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        prefix, _, kind = name.rpartition(".")
        if kind != "weight" or prefix.rsplit(".", 1)[-1] not in CHECKPOINT_LINEARS:
            tensors[name] = tensor
            continue
        tensors |= {f"{prefix}.{part}": t for part, t in awq_tensors(tensor.float(), group).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def engine_format(model: str, quantization: str, config: QuantCheckConfig, prompts: list[list[int]]) -> dict[str, Any]:
    from gpu_decode import engine_args

    from minivllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=config.output_len, temperature=0.0, ignore_eos=True)
    seqs = max(config.seqs)
    result: dict[str, Any] = {}
    extra = {"quantization": quantization, "worker_backend": "inprocess"}
    with LLM(**engine_args(model, config, seqs, config.cuda_graph_sizes), **extra) as llm:  # type: ignore[arg-type]
        graphs = llm._engine.workers.runners[0].graphs  # type: ignore[union-attr]  # a diagnostic: the worker's own
        replays = count_replays(graphs)
        graphed = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        result["graphs captured"] = graphs is not None and bool(graphs.graphs)
        result["graph replays"] = replays["n"]
        for n in config.seqs:
            result[f"decode tok/s, {n} seqs"] = decode_rate(llm, prompts[:n], config)
    with LLM(**engine_args(model, config, seqs, ""), **extra) as llm:  # type: ignore[arg-type]
        eager = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    result["graphs same as eager"] = f"{sum(a == b for a, b in zip(graphed, eager))}/{len(eager)}"
    result["tokens"] = graphed
    return result


def count_replays(graphs: Any) -> dict[str, int]:
    """A live count of the decode steps the worker's graphs replay."""
    counts = {"n": 0}
    if graphs is None:
        return counts
    run = graphs.run

    def counted(*args: Any) -> Any:
        counts["n"] += 1
        return run(*args)

    graphs.run = counted
    return counts


def decode_rate(llm: Any, prompts: list[list[int]], config: QuantCheckConfig) -> float:
    """Decode tokens/s: the best run to `output_len` tokens less the best run to one token."""
    from minivllm import SamplingParams

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(config.output_len)
    first = min(timed(1) for _ in range(config.runs))
    total = min(timed(config.output_len) for _ in range(config.runs))
    return len(prompts) * (config.output_len - 1) / max(total - first, 1e-9)


def summary_lines(part: dict[str, Any]) -> list[str]:
    if not part or "error" in part:
        return [f"| quantized weights | failed: {part['error']} |"] if part else []
    checks = part.get("kernels", [])
    bad = [f"{c['shape']} {c['dtype']} {c['format']} {c['rel err']:.1e}" for c in checks if not c["ok"]]
    worst = {f: max((c["rel err"] for c in checks if c["format"] == f), default=float("nan")) for f in FORMATS[1:]}
    lines = [f"| quantized layers vs float64 | {len(checks) - len(bad)}/{len(checks)} within tolerance {bad or ''}; "
             f"worst rel err {', '.join(f'{f} {e:.1e}' for f, e in worst.items())} |"]  # fmt: skip
    for shape in dict.fromkeys(r["shape"] for r in part.get("timings", [])):
        cells = [f"{r['format']} {r['rows']}: {r['us']:.0f} us ({r['vs bf16']:.2f}x)" for r in part["timings"]
                 if r["shape"] == shape and r["format"] != "none"]  # fmt: skip
        lines.append(f"| {shape} product vs bf16 | {'; '.join(cells)} |")
    for row in part.get("engine", []):
        if "error" in row:
            lines.append(f"| engine {row['format']} | failed: {row['error']} |")
            continue
        rates = ", ".join(f"{k.split(', ')[1]} {v:.0f}" for k, v in row.items() if k.startswith("decode tok/s"))
        lines.append(
            f"| engine {row['format']} | graphs {row['graphs captured']} ({row['graph replays']} replays), "
            f"tokens graphs = eager {row['graphs same as eager']}, = bf16 {row.get('same as bf16', '-')}; "
            f"decode tok/s {rates} |"
        )
    return lines


def sweep(config: QuantCheckConfig) -> list[dict[str, Any]]:
    """The quantized GEMMs' tiles at the timed shapes (AWQ in groups of 128, as 8B checkpoints are): each row count's
    candidates against the default tiles and bf16's matmul, then the best one's K split from 1 to 16. Prints the
    fastest of each; returns every row."""
    config = dataclasses.replace(config, awq_group=128)
    dtype = getattr(torch, config.dtype)
    rows: list[dict[str, Any]] = []
    for name, k, n in config.shapes:
        if name not in config.timed_shapes:
            continue
        weights = [torch.randn(n, k, device=config.device) * 0.02 for _ in range(3)]
        plain = [make_layer("none", w, config, dtype) for w in weights]
        for fmt in ("awq", "int8"):
            layers = [make_layer(fmt, w, config, dtype) for w in weights]
            for m in config.check_rows:
                x = torch.randn(m, k, device=config.device, dtype=dtype)
                bf16_us = graph_time(lambda i, x=x, plain=plain: plain[i % 3](x)) * 1e6
                r: dict[str, Any] = {"shape": name, "format": fmt, "rows": m, "bf16 us": bf16_us}
                rows.append(r | sweep_tiles(fmt, layers, x))
                r = rows[-1]
                print(f"sweep {name:10} {fmt:4} {m:4} rows: bf16 {bf16_us:6.1f} us, default {r['default us']:6.1f}, "
                      f"best {r['best us']:6.1f} {r['best tile']}; splits {r['splits us']}", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    return rows


def sweep_tiles(fmt: str, layers: list[Any], x: torch.Tensor) -> dict[str, Any]:
    """The default tiles' time, every candidate's, the best one and its time at each K split, for x [M, K]."""
    from kernels import triton_quant_gemm as qg

    def timed(tile: Any, split: int | None = None) -> float:
        def call(i: int) -> torch.Tensor:
            layer = layers[i % 3]
            if fmt == "awq":
                parts = (layer.part("qweight"), layer.part("qzeros"), layer.part("scales"))
                return qg.awq_gemm(x, *parts, layer.method.group_size, split_k=split, tile=tile)
            return qg.int8_gemm(x, layer.part("qweight"), layer.method._float_scales(layer), split_k=split, tile=tile)

        return graph_time(call) * 1e6

    found = []
    for tile in [None, *candidates(fmt, x.shape[0])]:
        try:
            found.append((timed(tile), tile))
        except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses (shared memory) is skipped
            print(f"sweep {fmt} {x.shape[0]}: {tile} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
    default_us = next(us for us, t in found if t is None)
    best_us, best = min(found, key=lambda t: t[0])
    splits = {s: round(timed(best, s), 1) for s in (1, 2, 4, 8, 16)}
    return {"default us": default_us, "best us": best_us, "best tile": best, "splits us": splits}


def candidates(fmt: str, rows: int) -> list[Any]:
    """Tiles to try at `rows` rows: decode's 16-row tiles by outputs, inputs and warps (AWQ: words gathered or
    widened); prefill's larger ones."""
    from kernels.triton_quant_gemm import Tiles

    block_m = 16 if rows <= 16 else 64
    gathers = (False, True) if fmt == "awq" else (False,)
    if rows <= 64:
        shapes = ((64, 64), (128, 64), (256, 64), (128, 128), (256, 128), (64, 128))
        return [Tiles(block_m, n, k, w, 3, g) for g in gathers for n, k in shapes for w in (4, 8)]
    return [Tiles(bm, n, 64, w, s, g) for g in gathers for bm in (64, 128) for n in (128, 256) for w in (4, 8)
            for s in (3, 4)]  # fmt: skip


def main() -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time the quantized GEMMs' candidate tiles (a GPU)")
    p.add_argument("--rows", default="1,16,64,256", help="row counts, comma-separated")
    p.add_argument("--out", type=Path, help="a JSON file for the rows")
    args = p.parse_args()
    config = QuantCheckConfig(check_rows=tuple(int(r) for r in args.rows.split(",")))
    result: Any = sweep(config) if args.sweep else quant_part(None, config)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
