"""minivllm beside llama.cpp on this CPU: the same weights (the default model, SmolLM2-135M), the same prompts (as
token ids), the same threads; each format's single-stream decode also as a share of the machine's bandwidth.

    .venv/bin/python scripts/bench_cpu_peer.py             # builds llama-server once (cached; ~25 min on 2 cores)
    .venv/bin/python scripts/bench_cpu_peer.py --no-llama  # minivllm and the bandwidth only
    .venv/bin/python scripts/bench_cpu_peer.py --smoke     # what CI runs: tiny sizes, no llama.cpp

One decode step of one sequence reads every weight once, so single-stream tok/s x weight bytes is the bandwidth a
format reaches; the yardstick is the machine's own, measured here by a STREAM-like copy (bytes read + written per
second, `--copy-mib` arrays, the threads of the run). llama.cpp: `llama-server` built from the llama-cpp-python
source distribution's vendored llama.cpp (scripts/llama_cpp_peer.py: pip download, cmake + ninja, under
~/.cache/minivllm/llama.cpp), the model converted to bf16 and q8_0 GGUF by its own convert_hf_to_gguf.py. One
stream: each engine's decode rate (minivllm: generate of N tokens less generate of 1, in process; llama-server:
its /completion timings), best of --repeats. A batch: --batch prompts at once, output tokens per wall second
(llama-server with as many slots, the requests sent together over HTTP). Pairs: bf16 with bf16, int8 with q8_0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import llama_cpp_peer  # noqa: E402
from bench_quant import TEXT, weight_bytes  # noqa: E402

from kernels import cpu_isa  # noqa: E402
from kernels.cpu_features import cpu_flags_line  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402
from worker_node.default_model import ensure_default_model  # noqa: E402

# minivllm's formats: (dtype, quantization); each one's llama.cpp peer (a GGUF type), where it has one.
FORMATS = {"float32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("bfloat16", "int8")}
PEERS = {"bf16": "bf16", "int8": "q8_0"}
FLAGS_SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def copy_bandwidth(mib: int, threads: int, repeats: int) -> float:
    """GB/s of a STREAM-like copy between two float32 arrays of `mib` MiB (bytes read + written), the fastest of
    `repeats` (the machine is shared: the fastest is the least disturbed)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**18)
    b = torch.zeros_like(a)  # its pages touched before the timing
    best = float("inf")
    for _ in range(max(5, repeats)):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return 2 * a.numel() * 4 / best / 1e9


def text_prompts(model: Path, count: int, length: int, vocab: int) -> list[list[int]]:
    """Prompts cut from bench_quant's text with the model's tokenizer (synthetic ids where it has none)."""
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415

        ids = AutoTokenizer.from_pretrained(str(model))(TEXT)["input_ids"]
    except (OSError, ValueError, TypeError, KeyError):  # no tokenizer in the folder
        ids = []
    if len(ids) < count + length:
        return [[(7 + 31 * i + 13 * j) % vocab for j in range(length)] for i in range(count)]
    return [ids[i : i + length] for i in range(count)]


def minivllm_row(model: Path, fmt: str, args: argparse.Namespace, batch: list[list[int]]) -> dict[str, Any]:
    """One format's figures: single-stream decode tok/s, batch tok/s, the weight bytes a decode step reads."""
    dtype, quantization = FORMATS[fmt]
    held = weight_bytes(model, quantization, dtype)
    if quantization == "int8":  # the head reads its int8 codes; the bf16 embedding it keeps, one row per token
        config = json.loads((model / "config.json").read_text())
        held -= 2 * config["vocab_size"] * config["hidden_size"]
    row: dict[str, Any] = {"engine": "minivllm", "format": fmt, "weight_MB": held / 1e6}
    with LLM(str(model), dtype=dtype, quantization=quantization, max_num_seqs=max(16, len(batch)),
             kv_cache_memory=args.kv_cache_memory, threads=args.threads) as llm:  # fmt: skip
        row["single_tok_s"] = max(single_stream(llm, batch[0], args.tokens) for _ in range(args.repeats))
        row["batch_tok_s"] = max(batch_rate(llm, batch, args.tokens) for _ in range(args.repeats))
        row["isa"] = cpu_isa.current() or "none"
        if fmt == "float32":  # the reference sequences: float32's greedy continuations of a few prompts
            args.reference = [
                list(ids) + out
                for ids, out in zip(batch, greedy(llm, batch[: args.agreement_prompts], args.agreement_tokens))
            ]
        if args.reference:
            row["within_0.5_of_fp32"] = agreement(llm, args.reference, args.prompt_len)
    print(f"measured: {row}", flush=True)  # a long run on a loaded machine: each row as it comes
    return row


def greedy(llm: LLM, ids: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(ids, [params] * len(ids), use_tqdm=False)]


def agreement(llm: LLM, sequences: list[list[int]], prompt_len: int) -> float:
    """Share of float32's greedy positions (teacher-forced on its sequences) where this engine's logprob of float32's
    token is within 0.5 of its own best: the quantization issue's agreement bar (>= 97 % for int8)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    gaps = []
    for out in llm.generate(sequences, [params] * len(sequences), use_tqdm=False):
        entries = (out.prompt_logprobs or [])[prompt_len:]  # entry i scores token i given the tokens before it
        gaps += [e.top[0][1] - e.logprob for e in entries if e is not None]
    return sum(gap <= 0.5 for gap in gaps) / len(gaps)


def generate_seconds(llm: LLM, ids: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(ids, [params] * len(ids), use_tqdm=False)
    elapsed = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != tokens for o in outs):
        raise RuntimeError("the engine stopped short of the tokens it was asked for")
    return elapsed


def single_stream(llm: LLM, ids: list[int], tokens: int) -> float:
    """Decode tokens per second of one sequence: N tokens' time less 1 token's (the prefill), over N - 1."""
    return (tokens - 1) / (generate_seconds(llm, [ids], tokens) - generate_seconds(llm, [ids], 1))


def batch_rate(llm: LLM, batch: list[list[int]], tokens: int) -> float:
    return len(batch) * tokens / generate_seconds(llm, batch, tokens)


def llama_rows(model: Path, args: argparse.Namespace, batch: list[list[int]]) -> list[dict[str, Any]]:
    """llama-server's figures for each GGUF type of PEERS (built and converted first where not cached)."""
    server = llama_cpp_peer.ensure_server(args.llama_cache)
    rows = []
    for kind in PEERS.values():
        gguf = llama_cpp_peer.convert(model, kind, args.llama_cache)
        context = len(batch) * (len(batch[0]) + args.tokens + 16)
        with llama_cpp_peer.Server(server, gguf, args.threads, len(batch), context) as peer:
            row: dict[str, Any] = {"engine": "llama.cpp", "format": kind, "weight_MB": gguf.stat().st_size / 1e6}
            row["single_tok_s"] = max(peer.single_stream(batch[0], args.tokens) for _ in range(args.repeats))
            row["batch_tok_s"] = max(peer.batch_rate(batch, args.tokens) for _ in range(args.repeats))
        rows.append(row)
        print(f"measured: {row}", flush=True)
    return rows


def add_shares(rows: list[dict[str, Any]], bandwidth: float) -> None:
    """Each row's single-stream read rate (GB/s) and its share of the copy bandwidth; minivllm's against its peer."""
    by_key = {(r["engine"], r["format"]): r for r in rows}
    for row in rows:
        row["read_GB_s"] = row["single_tok_s"] * row["weight_MB"] / 1e3
        row["share_of_copy"] = row["read_GB_s"] / bandwidth
        peer = by_key.get(("llama.cpp", PEERS.get(row["format"], ""))) if row["engine"] == "minivllm" else None
        if peer:
            row["single_vs_peer"] = row["single_tok_s"] / peer["single_tok_s"]
            row["batch_vs_peer"] = row["batch_tok_s"] / peer["batch_tok_s"]


def print_table(report: dict[str, Any]) -> None:
    print(f"## CPU decode beside llama.cpp: {report['cpu']} ({report['flags']}), {report['threads']} threads, "
          f"load {report['load']}; copy bandwidth {report['copy_GB_s']:.1f} GB/s")  # fmt: skip
    print("| engine | format | weight MB | 1 stream tok/s | read GB/s | share of copy | "
          f"batch {report['batch']} tok/s | vs llama.cpp (1 / batch) | within 0.5 of fp32's token |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in report["rows"]:
        peer = f"{r['single_vs_peer']:.2f}x / {r['batch_vs_peer']:.2f}x" if "single_vs_peer" in r else ""
        agree = f"{r['within_0.5_of_fp32']:.1%}" if "within_0.5_of_fp32" in r else ""
        cells = [r["engine"], r["format"], f"{r['weight_MB']:.0f}", f"{r['single_tok_s']:.1f}", f"{r['read_GB_s']:.1f}",
                 f"{r['share_of_copy']:.0%}", f"{r['batch_tok_s']:.1f}", peer, agree]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    if report.get("skipped"):
        print(f"skipped: {report['skipped']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--formats", default="float32,bf16,int8", help=f"minivllm formats, of {', '.join(FORMATS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of both engines")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per sequence")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences at once in the batch figure")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (the fastest counts)")
    p.add_argument("--copy-mib", type=int, default=256, help="MiB per array of the bandwidth copy")
    p.add_argument(
        "--agreement-prompts", type=int, default=4, help="prompts of the agreement check (64 greedy tokens each)"
    )
    p.add_argument("--kv-cache-memory", default="1GiB", help="minivllm's KV cache")
    p.add_argument("--llama-cache", type=Path, default=llama_cpp_peer.CACHE, help="llama.cpp's build and GGUFs")
    p.add_argument("--no-llama", action="store_true", help="minivllm and the bandwidth only")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, no llama.cpp: checks the script (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    args.reference, args.agreement_tokens = [], 64  # float32's greedy sequences, once its row has run
    if args.smoke:
        args.agreement_tokens = 4
        args.tokens, args.prompt_len, args.batch, args.repeats, args.copy_mib = 4, 8, 2, 1, 8
        args.kv_cache_memory, args.no_llama = "64MiB", True
    return args


def main() -> int:
    args = parse_args()
    model = ensure_default_model() if args.model == "default" else Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batch = text_prompts(model, args.batch, args.prompt_len, vocab)
    flags = set(cpu_flags_line().partition(":")[2].split())
    report: dict[str, Any] = {
        "cpu": llama_cpp_peer.cpu_model(),
        "flags": " ".join(f for f in FLAGS_SHOWN if f in flags),
        "threads": args.threads,
        "batch": args.batch,
        "copy_GB_s": copy_bandwidth(args.copy_mib, args.threads, max(3, args.repeats)),
        "rows": [minivllm_row(model, fmt, args, batch) for fmt in args.formats.split(",")],
        "skipped": "llama.cpp (--smoke or --no-llama)" if args.no_llama else "",
    }
    if not args.no_llama:
        report["rows"] += llama_rows(model, args, batch)
    add_shares(report["rows"], report["copy_GB_s"])
    report["load"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
