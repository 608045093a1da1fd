"""The decode part of the GPU check (scripts/gpu_check.py, issue 24): is small-model decode GPU-bound?

For each batch size (64 and 256 sequences by default) on SmolLM2's shape in bf16 with the Triton kernels replayed
from CUDA graphs, through `minivllm.LLM` (the engine core, its worker in this process):

- decode tokens/s: a run to `output_len` tokens less a run to one token, over the tokens between (the best of
  `runs`, after a warm-up that compiles the kernels and captures the graphs; bench_kernels.engine_run);
- the share of the run's time the device was idle: one more run under the torch profiler; the union of the
  device's kernel intervals against the span from its first to its last (prefill included: one step of
  `output_len`; the profiler sees the kernels of every thread's launches); nan on a CPU dry run;
- the same decode with every step finished before the next is launched (`overlap_steps="off"`): what the
  overlapped steps (worker_node/step_overlap.py, on by default on CUDA) buy;
- HF `generate` on the same device, same prompts, same dtype, greedy to `output_len` tokens (eos ignored), as
  a peer: its decode tokens/s the same way, and minivllm's ratio to it.

`dry_run_config` gives the same code paths at a tiny size on the CPU (what CI runs, on a tiny random llama: HF
generate of SmolLM2 on a loaded 2-core machine takes seconds a token).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

GRAPH_SIZES = "1,2,4,8,16,32,64,128,256"


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    seqs: tuple[int, ...] = (64, 256)
    prompt_len: int = 128
    output_len: int = 128
    runs: int = 2
    kv_memory: str = "16GiB"
    attention_backend: str = "triton"
    cuda_graph_sizes: str = GRAPH_SIZES


class EngineShape(Protocol):
    """What a GPU check's config says about the engine it builds (DecodeConfig, gpu_lora's LoraCheckConfig)."""

    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def kv_memory(self) -> str: ...
    @property
    def attention_backend(self) -> str: ...


def engine_args(folder: str, config: EngineShape, seqs: int, cuda_graph_sizes: str) -> dict[str, Any]:
    """`LLM`'s arguments for a decode check of `seqs` sequences (every one fits one step's token budget)."""
    return dict(
        model=folder,
        device=config.device,
        dtype=config.dtype,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, seqs * 8),
        kv_cache_memory=config.kv_memory,
        attention_backend=config.attention_backend,
        cuda_graph_sizes=cuda_graph_sizes,
    )


def dry_run_config() -> DecodeConfig:
    """The same parts at a tiny size on the CPU: 2 and 4 sequences of 8 prompt tokens, 3 output tokens, fp32."""
    return DecodeConfig("cpu", "float32", (2, 4), 8, 3, 1, "64MiB", "torch", "")


def decode_part(model: str | None, config: DecodeConfig, prompts_of: Callable[[int], list[str]]) -> dict[str, Any]:
    """Every batch size's row: minivllm's decode tok/s and device idle share, HF generate's tok/s, the ratio.
    `prompts_of(n)`: n text prompts of about `config.prompt_len` tokens."""
    from worker_node.default_model import ensure_default_model

    folder = model or str(ensure_default_model())
    rows = []
    for n in config.seqs:
        prompts = prompts_of(n)
        row: dict[str, Any] = {"seqs": n}
        row |= engine_decode(folder, config, prompts)
        row["decode tok/s, not overlapped"] = sequential_decode(folder, config, prompts)
        row |= hf_decode(folder, config, prompts)
        row["vs HF"] = row["decode tok/s"] / row["HF decode tok/s"]
        rows.append(row)
    return {"model": folder, "config": dataclasses.asdict(config), "rows": rows}


def engine_decode(folder: str, config: DecodeConfig, prompts: list[str]) -> dict[str, Any]:
    """minivllm's decode tokens/s and the device's idle share over one more run."""
    from bench_kernels import engine_run

    from minivllm import LLM, SamplingParams

    kwargs = engine_args(folder, config, len(prompts), config.cuda_graph_sizes)
    stats, _ = engine_run(kwargs, prompts, config.output_len, config.runs)
    params = SamplingParams(max_tokens=config.output_len, temperature=0.0, ignore_eos=True)
    with LLM(**kwargs) as llm:  # type: ignore[arg-type]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        with profiler(config.device) as prof:
            llm.generate(prompts, params, use_tqdm=False)
    return {"decode tok/s": stats["decode tok/s"], "device idle": idle_share(prof, config.device)}


def sequential_decode(folder: str, config: DecodeConfig, prompts: list[str]) -> float:
    """The decode tokens/s with every step finished before the next is launched (`overlap_steps="off"`; the
    default overlaps them on CUDA, worker_node/step_overlap.py): what overlapping buys, in the same run."""
    from bench_kernels import engine_run

    kwargs = engine_args(folder, config, len(prompts), config.cuda_graph_sizes) | {"overlap_steps": "off"}
    stats, _ = engine_run(kwargs, prompts, config.output_len, config.runs)
    return float(stats["decode tok/s"])


def profiler(device: str) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def idle_share(prof: torch.profiler.profile, device: str) -> float:
    """1 - (the union of the device's busy intervals) / (their span)."""
    cuda = torch.autograd.DeviceType.CUDA
    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]
    return 1.0 - busy(intervals) / span(intervals) if intervals else float("nan")  # nan: no device (a dry run)


def busy(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def span(intervals: list[tuple[float, float]]) -> float:
    return max(1e-9, max(stop for _, stop in intervals) - min(start for start, _ in intervals))


def hf_decode(folder: str, config: DecodeConfig, prompts: list[str]) -> dict[str, Any]:
    """HF generate's decode tokens/s on the same prompts: a batch padded on the left, greedy, eos ignored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, config.dtype))
    model.to(torch.device(config.device)).eval()  # type: ignore[arg-type]
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(config.device)

    def timed(new_tokens: int) -> float:
        sync(config.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        sync(config.device)
        assert out.shape[1] == batch["input_ids"].shape[1] + new_tokens
        return time.perf_counter() - start

    timed(config.output_len)  # warm-up
    first = min(timed(1) for _ in range(config.runs))
    total = min(timed(config.output_len) for _ in range(config.runs))
    decode_tokens = len(prompts) * (config.output_len - 1)
    return {"HF decode tok/s": decode_tokens / max(total - first, 1e-9)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def summary_lines(part: dict[str, Any]) -> list[str]:
    return [
        f"| decode {r['seqs']} seqs | {r['decode tok/s']:.0f} tok/s, device idle {100 * r['device idle']:.0f}%, "
        f"steps not overlapped {r['decode tok/s, not overlapped']:.0f} tok/s, "
        f"HF generate {r['HF decode tok/s']:.0f} tok/s ({r['vs HF']:.2f}x) |"
        for r in part.get("rows", [])
    ]
