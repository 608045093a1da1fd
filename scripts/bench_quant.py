"""Quantized weights vs the model in --dtype (auto: bf16, or float32 on CPUs without bf16 dot products) on one CPU, in
one run: per format, the weight bytes a rank holds, decode tok/s at 1, 16 and 64 sequences, prefill tok/s, the mixed
workload of bench_throughput.py, and fidelity to the first format (the reference, the unquantized model): top-1
agreement over --positions generated positions (the reference generates greedily from prompts cut from a fixed text;
each format is teacher-forced on those sequences and its argmax at each generated position compared with the
reference's argmax there, teacher-forced too, and with the token the reference generated, the reference's own figure
of the latter being its prefill vs decode noise floor) and perplexity on the fixed text.

    .venv/bin/python scripts/bench_quant.py                      # SmolLM2-135M, none (--dtype auto) and int8
    .venv/bin/python scripts/bench_quant.py --kernels            # also the int8 kernels per row count
    .venv/bin/python scripts/bench_quant.py --smoke              # what CI runs: a tiny model, tiny sizes

Every engine runs in-process (minivllm.LLM), one format at a time, with --threads threads. Decode figures count
output tokens over the whole generate call of N sequences (16-token prompts prefilled first); prefill figures are
prompt tokens over a generate call that asks for one output token each. The machine is shared: only ratios
inside one run mean much. `--rounds N` measures the decode figures N times, the formats in turn each round (a fresh
engine each time), and reports each format's median and the spread of its per-round ratios to the first format:
this machine's memory bandwidth drifts by tens of percent within minutes, which one pass per format cannot tell
from a format's speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_throughput import workload  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402

# A fixed English text for agreement and perplexity (random token ids would make every model's argmax noise).
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a screw "
    "press with movable metal type, oil-based ink and a mould that cast letters quickly and evenly. Before him, "
    "books in Europe were copied by hand, a slow and costly craft that kept them in the hands of monasteries, "
    "universities and the very rich. Within fifty years of his first Bible, presses were at work in more than two "
    "hundred cities, and millions of volumes had been printed. Prices fell, literacy spread, and ideas travelled "
    "faster than ever before. Scholars could compare identical copies of a text, which made errors easier to find "
    "and arguments easier to follow. Merchants printed price lists and maps; governments printed laws; reformers "
    "printed pamphlets that reached readers far beyond the pulpit. The new machine did not only copy books, it "
    "changed what a book was: title pages, page numbers, indexes and standard spellings all grew out of the need "
    "to sell many identical copies to strangers. In the centuries that followed, steam power, cheaper paper and "
    "faster presses turned printing into an industry. Newspapers appeared in every large town, and by the "
    "nineteenth century a worker could buy a daily paper for a penny. Photography, the telegraph and later the "
    "radio each promised to replace the printed page, yet each ended up feeding it with news and pictures. Today "
    "most text is read on screens, but the habits formed by print remain: we still expect a document to have an "
    "author, a date, a fixed form and a place on a shelf, even when the shelf is a server on the other side of "
    "the world. Historians continue to debate how much of the scientific revolution, the reformation and the rise "
    "of the modern state can be credited to the press, but few doubt that the ability to copy words cheaply and "
    "exactly was one of the turning points of human history. The same question is now asked of the machines that "
    "write text themselves: whether they will change what a text is, as the press did, or only how fast it is made."
)


def engine(model: Path, fmt: str, args: argparse.Namespace) -> LLM:
    return LLM(
        str(model),
        dtype=args.dtype,
        quantization=fmt,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        threads=args.threads,
    )


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int], cpu: list[float] | None = None) -> float:
    """Wall seconds of one generate call; its CPU seconds (this process's, every thread: the engine runs in it)
    appended to `cpu` when given (steadier than wall time on a loaded machine)."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    start, start_cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    if [len(o.outputs[0].token_ids) for o in outs] != max_tokens:
        raise RuntimeError("an engine stopped short of the tokens it was asked for")
    return elapsed


def next_token_scores(llm: LLM, ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Teacher-forced over each of `ids`: the argmax at each position and the logprob of the token that follows."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    best, logprobs = [], []
    for out in llm.generate(ids, [params] * len(ids), use_tqdm=False):
        entries = [e for e in (out.prompt_logprobs or [])[1:] if e is not None]
        best.append([e.top[0][0] for e in entries])
        logprobs.append([e.logprob for e in entries])
    return best, logprobs


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [params] * len(prompts), use_tqdm=False)]


def agreement(best: list[list[int]], prompts: list[list[int]], expected: list[list[int]]) -> float:
    """Share of the generated positions where this model's argmax (teacher-forced on the reference's sequences)
    is the expected token there: `expected[i][j]` for the j-th generated position of sequence i."""
    found = generated_positions(best, prompts, expected)
    same = sum(a == t for argmaxes, tokens in zip(found, expected) for a, t in zip(argmaxes, tokens))
    return same / sum(len(tokens) for tokens in expected)


def generated_positions(best: list[list[int]], prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """The argmaxes of `best` (teacher-forced scores) at the generated positions of each sequence (argmax[i]
    predicts token i + 1, so a sequence's first generated token is its prompt's last position's)."""
    return [argmax[len(p) - 1 : len(p) - 1 + len(o)] for argmax, p, o in zip(best, prompts, outputs)]


def weight_bytes(model: Path, fmt: str, dtype: str) -> int:
    import torch

    from kernels.backend import select_attention_backend
    from worker_node.loading import pick_dtype
    from worker_node.models.loader import load_model
    from worker_node.models.quantize import weight_bytes as held

    cpu = torch.device("cpu")
    loaded = load_model(
        model, select_attention_backend("torch", cpu), pick_dtype(dtype, cpu), cpu, 64, quantization=fmt
    )
    return held(loaded)


def decode_round(model: Path, fmt: str, args: argparse.Namespace, vocab: int, row: dict[str, Any]) -> None:
    """One more round of `row`'s decode figures, in a fresh engine (appended to its `decode_*_rounds` lists)."""
    with engine(model, fmt, args) as llm:
        timed_generate(llm, [[5, 6, 7]], [2])  # warm-up
        decode_figures(llm, args, vocab, row)


def decode_figures(llm: LLM, args: argparse.Namespace, vocab: int, row: dict[str, Any]) -> None:
    """Decode tok/s and tok per CPU second at each of --decode-seqs, appended to `row`'s lists of rounds."""
    rng = random.Random(0)
    for n in args.decode_seqs:
        prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]
        cpu: list[float] = []
        wall = timed_generate(llm, prompts, [args.decode_tokens] * n, cpu)
        row.setdefault(f"decode_{n}_tok_s_rounds", []).append(n * args.decode_tokens / wall)
        row.setdefault(f"decode_{n}_tok_per_cpu_s_rounds", []).append(n * args.decode_tokens / cpu[0])


def settle_rounds(rows: list[dict[str, Any]]) -> None:
    """Each decode figure as the median of its rounds, and the range of its per-round ratios to the first row's."""
    for key in [k for k in rows[0] if k.endswith("_rounds")]:
        figure = key.removesuffix("_rounds")
        for row in rows:
            row[figure] = statistics.median(row[key])
            ratios = [a / b for a, b in zip(row[key], rows[0][key])]
            row[f"{figure}_ratio_range"] = (min(ratios), max(ratios))


def measure(
    model: Path, fmt: str, args: argparse.Namespace, text_ids: list[int], vocab: int, reference: dict[str, Any]
) -> dict[str, Any]:
    """One format's row, its first round of decode figures included; the first format generates the reference
    tokens (`reference`, filled in)."""
    row: dict[str, Any] = {"format": fmt, "weight_MB": weight_bytes(model, fmt, args.dtype) / 1e6}
    rng = random.Random(1)
    with engine(model, fmt, args) as llm:
        if not reference:
            reference["prompts"] = prompts = agreement_prompts(text_ids, args.agreement_prompts)
            reference["outputs"] = greedy(llm, prompts, args.positions // len(prompts))
        sequences = [p + o for p, o in zip(reference["prompts"], reference["outputs"])]
        best, _ = next_token_scores(llm, sequences)
        # Two comparisons with the reference, both over its generated positions and both teacher-forced on its
        # sequences: with its argmax on the same sequences (the models compared on the same inputs, by the same
        # prefill path: the reference scores 100 %), and with the tokens it generated (decoding: the reference's
        # own figure is then its prefill vs decode noise floor, near-ties its two paths round apart).
        reference.setdefault("best", generated_positions(best, reference["prompts"], reference["outputs"]))
        row["top1_agreement"] = agreement(best, reference["prompts"], reference["best"])
        row["top1_vs_generated"] = agreement(best, reference["prompts"], reference["outputs"])
        timed_generate(llm, [[5, 6, 7]], [2])  # warm-up
        if not args.fidelity_only:
            decode_figures(llm, args, vocab, row)
        if args.fidelity_only or args.decode_only:
            _, logprobs = next_token_scores(llm, [text_ids])
            row["perplexity"] = math.exp(-sum(logprobs[0]) / len(logprobs[0]))
            return row
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prefill_len)] for _ in range(args.prefill_seqs)]
        row["prefill_tok_s"] = args.prefill_seqs * args.prefill_len / timed_generate(llm, prompts, [1] * len(prompts))
        work = workload(args.mixed_requests, 0, vocab, *args.mixed_ranges)
        mixed = timed_generate(llm, [p for p, _ in work], [o for _, o in work])
        row["mixed_tok_s"] = sum(o for _, o in work) / mixed
        _, logprobs = next_token_scores(llm, [text_ids])
    row["perplexity"] = math.exp(-sum(logprobs[0]) / len(logprobs[0]))
    return row


def agreement_prompts(text_ids: list[int], n: int) -> list[list[int]]:
    """`n` prompts of 24 tokens from evenly spaced places in the fixed text."""
    step = len(text_ids) // n
    return [text_ids[i * step : i * step + 24] for i in range(n)]


def awq_tensors(w: Any, group: int, gen: Any) -> tuple[Any, Any, Any]:
    """Random AWQ codes [K, N], zero points and scales [K/G, N] of w's shape [N, K] (the kernels' speed does not
    depend on the values)."""
    import torch

    n, k = w.shape
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    return codes, zeros, torch.rand(k // group, n, generator=gen) / 500


def int4_layout(codes: Any, zeros: Any, scales: Any) -> tuple[Any, Any]:
    """torch's int4 layout and bf16 (scale, offset) pairs, as quant_awq makes them for torch's kernel."""
    import torch

    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.t().contiguous().int(), 1)
    return packed, torch.stack([scales, (8 - zeros).float() * scales], dim=-1).bfloat16()


def kernel_table(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    """ms of one SmolLM2 decoder layer's four projections (and of the LM head) per kernel and row count: torch's
    dense matmuls, its int8 weight-only paths, fbgemm's dynamic W8A8 (measured, not used: see the guide), its int4
    kernel (AWQ's fallback), the AMX kernel for bf16 and int8 weights, the latter also against activations
    quantized to 16 and 8 bits (kernels/cpu_gemm.py), and the AWQ int4 kernel (kernels/cpu_gemm_awq.py), the last
    two where the CPU has AMX; the portable kernel (kernels/cpu_gemm_portable.py): int8 on float32 and bf16 rows,
    AWQ int4 on float32 rows."""
    import warnings

    import torch
    import torch.nn.functional as F
    from bench_cpu_dtypes import fastest_ms  # this script's sibling: the dense matmuls' own table

    from kernels import cpu_gemm, cpu_gemm_awq, cpu_gemm_portable
    from worker_node.models.quant_int8 import quantize_rows

    def fbgemm(q: torch.Tensor, s: torch.Tensor) -> Any:
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated
            warnings.simplefilter("ignore")
            qt = torch._make_per_channel_quantized_tensor(q, s.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qt, None)

    gen = torch.Generator().manual_seed(0)
    shapes = {"layer": [(960, 576), (576, 576), (3072, 576), (576, 1536)], "head": [(49152, 576)]}
    table = []
    for what, dims in shapes.items():
        full = [torch.randn(o, i, generator=gen) * 0.02 for o, i in dims]
        bf16 = [w.bfloat16() for w in full]
        q = [(qw, s.bfloat16()) for qw, s in map(quantize_rows, full)]
        q32 = [(qw, s.float()) for qw, s in q]
        packed = [fbgemm(qw, s.float()) for qw, s in q]
        awq_parts = [awq_tensors(w, 64, gen) for w in full]
        awq = [cpu_gemm_awq.repack(*parts) for parts in awq_parts]
        int4 = [int4_layout(*parts) for parts in awq_parts]
        chunk = cpu_gemm_portable.int4_chunk()
        portable4 = [cpu_gemm_portable.repack_int4(*parts, chunk) for parts in awq_parts] if chunk else []
        for n in rows:
            xs = [torch.randn(n, w.shape[1], generator=gen) for w in full]
            xb = [x.bfloat16() for x in xs]
            kernels = {
                "fp32 matmul": lambda xs=xs, ws=full: [F.linear(x, w) for x, w in zip(xs, ws)],
                "bf16 matmul": lambda xs=xb, ws=bf16: [F.linear(x, w) for x, w in zip(xs, ws)],
                "int8pack_mm": lambda xs=xb, q=q: [
                    torch.ops.aten._weight_int8pack_mm(x, w, s) for x, (w, s) in zip(xs, q)
                ],
                "int8 -> bf16, matmul": lambda xs=xb, q=q: [
                    F.linear(x, w.to(torch.bfloat16)) * s for x, (w, s) in zip(xs, q)
                ],
                "int8 -> fp32, matmul": lambda xs=xs, q=q32: [F.linear(x, w.float()) * s for x, (w, s) in zip(xs, q)],
                "W8A8 fbgemm dynamic": lambda xs=xs, p=packed: [
                    torch.ops.quantized.linear_dynamic(x, w) for x, w in zip(xs, p)
                ],
            }
            kernels["int4pack_mm (AWQ g64)"] = lambda xs=xb, q=int4: [
                torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 64, p) for x, (w, p) in zip(xs, q)
            ]
            if cpu_gemm.load() is not None and n <= cpu_gemm.MAX_ROWS:  # the AMX kernel (kernels/cpu_gemm.py)
                kernels["AMX bf16"] = lambda xs=xb, ws=bf16: [cpu_gemm.linear(x, w) for x, w in zip(xs, ws)]
                kernels["AMX int8"] = lambda xs=xb, q=q32: [cpu_gemm.linear_int8(x, w, s) for x, (w, s) in zip(xs, q)]
            if cpu_gemm.has_int8():  # the codes times per-row quantized activations: 16 bits (used) and 8 (W8A8)
                kernels["AMX int8 x a16"] = lambda xs=xb, q=q32: [
                    cpu_gemm.linear_int8_act(x, w, s, 16) for x, (w, s) in zip(xs, q)
                ]
                kernels["AMX int8 x a8 (W8A8)"] = lambda xs=xb, q=q32: [
                    cpu_gemm.linear_int8_act(x, w, s, 8) for x, (w, s) in zip(xs, q)
                ]
            if cpu_gemm_portable.load() is not None and n <= cpu_gemm_portable.MAX_ROWS:  # the portable int8 kernel
                kernels["int8 portable, fp32"] = lambda xs=xs, q=q32: [
                    cpu_gemm_portable.linear(x, w, s) for x, (w, s) in zip(xs, q)
                ]
                kernels["int8 portable, bf16"] = lambda xs=xb, q=q32: [
                    cpu_gemm_portable.linear(x, w, s) for x, (w, s) in zip(xs, q)
                ]
            if chunk is not None:  # the portable kernel's AWQ entry (CPUs without AMX)
                kernels["AWQ int4 portable (g64), fp32"] = lambda xs=xs, q=portable4: [
                    cpu_gemm_portable.linear_int4(x, *p) for x, p in zip(xs, q)
                ]
            if cpu_gemm_awq.load() is not None:  # the AWQ int4 kernel (kernels/cpu_gemm_awq.py)
                kernels["AWQ int4 (g64)"] = lambda xs=xb, q=awq: [cpu_gemm_awq.linear(x, *p) for x, p in zip(xs, q)]
            table.append({"what": what, "rows": n, **{k: fastest_ms(run, repeats) for k, run in kernels.items()}})
            cells = ", ".join(f"{k} {v:.3f}" for k, v in table[-1].items() if isinstance(v, float))
            print(f"kernels {what} rows {n}: {cells}", flush=True)
    return table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument(
        "--formats",
        default="none,int8",
        help="--quantization values, comma-separated, the first the reference; FORMAT@FOLDER runs a checkpoint "
        "in that format (e.g. awq@./smollm2-awq)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="the engines' --dtype; auto: the worker's (bf16 where the CPU has bf16 dot products, else float32)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="the engines' step budget; 64 makes the teacher-forced checks run in decode-sized steps (the CPU "
        "kernels of at most 64 rows) instead of one prefill",
    )
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-seqs", default="1,16,64", help="sequence counts of the decode figures, comma-separated")
    p.add_argument("--decode-only", action="store_true", help="agreement and decode figures; no prefill or mixed")
    p.add_argument(
        "--rounds", type=int, default=1, help="decode figures measured this many times, the formats in turn each round"
    )
    p.add_argument("--positions", type=int, default=400, help="generated positions compared with the first format")
    p.add_argument("--agreement-prompts", type=int, default=4, help="prompts those positions are generated from")
    p.add_argument("--fidelity-only", action="store_true", help="weight bytes, agreement and perplexity; no speeds")
    p.add_argument("--kernels", action="store_true", help="also time the int8 kernels per row count")
    p.add_argument("--smoke", action="store_true", help="a tiny model and tiny sizes: checks the script (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    args.decode_seqs, args.prefill_seqs, args.prefill_len = [int(n) for n in args.decode_seqs.split(",")], 8, 256
    args.mixed_requests, args.mixed_ranges = 48, ((32, 512), (16, 256))
    if args.smoke:
        args.decode_seqs, args.decode_tokens, args.prefill_seqs, args.prefill_len = [1, 4], 4, 2, 32
        args.mixed_requests, args.mixed_ranges, args.positions, args.agreement_prompts = 4, ((8, 24), (2, 6)), 40, 2
        args.kv_cache_memory = "128MiB"
    return args


def main() -> int:
    args = parse_args()
    from scheduler_node.engine.model_path import resolve_model
    from scheduler_node.text.tokenizer import ModelTokenizer

    model = resolve_model(args.model)
    tokenizer = ModelTokenizer(model)
    text_ids = tokenizer.encode(TEXT)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "dtype": args.dtype,
        "rows": [],
    }
    if args.kernels:
        report["kernels"] = kernel_table([1, 4, 16, 64, 256] if not args.smoke else [1, 16], 3 if args.smoke else 20)
    rows, reference = report["rows"], dict[str, Any]()
    entries = [entry.partition("@") for entry in args.formats.split(",")]
    formats = [(fmt, Path(folder) if folder else model) for fmt, _, folder in entries]  # awq@FOLDER: a checkpoint
    for fmt, folder in formats:
        rows.append(measure(folder, fmt, args, text_ids, tokenizer.vocab_size, reference))
        print(f"{fmt}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items() if isinstance(v, float)), flush=True)
    for _ in range(1, 0 if args.fidelity_only else args.rounds):
        for (fmt, folder), row in zip(formats, rows):
            decode_round(folder, fmt, args, tokenizer.vocab_size, row)
    settle_rounds(rows)
    report["load_average_after"] = os.getloadavg()
    print_table(report, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def print_table(report: dict[str, Any], args: argparse.Namespace) -> None:
    rows, base = report["rows"], report["rows"][0]
    print(f"\n{report['date']}, {args.threads} threads, {args.dtype} activations, load {report['load_average']}")
    decode = [f"decode {n} seqs" for n in args.decode_seqs]
    decode_cpu = [f"decode {n} (tok per CPU s)" for n in args.decode_seqs]
    agree = ["top-1 agreement (argmax vs argmax)", "top-1 vs generated tokens"]
    head = ["format", "weight MB", *decode, *decode_cpu, "prefill", "mixed", *agree, "perplexity"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        speeds = [f"decode_{n}_tok_s" for n in args.decode_seqs] + [
            f"decode_{n}_tok_per_cpu_s" for n in args.decode_seqs
        ]
        speeds += ["prefill_tok_s", "mixed_tok_s"]
        cells = [cell(r, base, k) for k in speeds]
        print(
            f"| {r['format']} | {r['weight_MB']:.0f} | "
            + " | ".join(cells)
            + f" | {100 * r['top1_agreement']:.1f}% | {100 * r['top1_vs_generated']:.1f}% | {r['perplexity']:.2f} |"
        )


def cell(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """A figure and its ratio to the first row's; with several rounds, the median and the rounds' range of ratios."""
    if key not in row:
        return "-"
    text = f"{row[key]:.1f} ({row[key] / base[key]:.2f}x"
    low, high = row.get(f"{key}_ratio_range", (0.0, 0.0))
    return text + (f", {low:.2f}-{high:.2f}x)" if high > low else ")")


if __name__ == "__main__":
    sys.exit(main())
