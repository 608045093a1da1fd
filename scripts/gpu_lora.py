"""The LoRA part of the GPU check (scripts/gpu_check.py, issue 29): adapter rows inside captured decode graphs.

SmolLM2's shape in bf16 with the Triton kernels, through `minivllm.LLM` with --enable-lora (its worker in this
process), on a batch whose rows take `adapters` random adapters of rank `rank` and the base model in turn:

- graphs: whether the worker captured its decode graphs with the LoRA slot bank (worker_node/lora/slot_bank.py),
  and how many decode steps holding adapter rows replayed them;
- tokens: the mixed batch's greedy tokens from the graphs against the same engine without CUDA graphs (eager, the
  same kernels): rows equal in full, and rows whose first decode token agrees (bf16: a late parting is rounding,
  an early one a bug);
- decode tok/s of the mixed batch and of the base-model batch in the same engine (what the adapters cost), and of
  the mixed batch eagerly (what the graphs save); each a run to `output_len` tokens less a run to one token.

`dry_run_config` runs the same code on the CPU at a tiny size (no graphs there: the graph counts are 0).
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lora import write_adapter
from gpu_decode import engine_args

from minivllm import LLM, LoRARequest, SamplingParams
from proto.lora import BaseShapes


@dataclass(frozen=True, slots=True)
class LoraCheckConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    seqs: int = 32
    prompt_len: int = 64
    output_len: int = 64
    adapters: int = 4
    rank: int = 16
    runs: int = 2
    kv_memory: str = "8GiB"
    attention_backend: str = "triton"
    cuda_graph_sizes: str = "1,2,4,8,16,32"


def dry_run_config() -> LoraCheckConfig:
    """The same code at a tiny size on the CPU: 4 sequences over 2 adapters of rank 4, 3 output tokens, fp32."""
    return LoraCheckConfig("cpu", "float32", 4, 8, 3, 2, 4, 1, "64MiB", "torch", "")


def lora_part(model: str | None, config: LoraCheckConfig) -> dict[str, Any]:
    from worker_node.default_model import ensure_default_model

    folder = model or str(ensure_default_model())
    with tempfile.TemporaryDirectory(prefix="gpu-lora-") as root:
        return lora_runs(folder, Path(root), config)


def lora_runs(folder: str, root: Path, config: LoraCheckConfig) -> dict[str, Any]:
    """`lora_part` with its adapters written under `root`."""
    shapes = BaseShapes.from_folder(Path(folder))
    paths = [write_adapter(root / f"a{i}", shapes, config.rank, seed=i) for i in range(config.adapters)]
    adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    groups = config.adapters + 1  # each adapter, then the base model
    mixed = [adapters[i % groups] if i % groups < config.adapters else None for i in range(config.seqs)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(config.prompt_len)] for _ in range(config.seqs)]
    graphed = engine_lora(folder, config, config.cuda_graph_sizes, prompts, mixed)
    eager = engine_lora(folder, config, "", prompts, mixed)
    same = sum(a == b for a, b in zip(graphed.pop("tokens"), eager["tokens"]))
    first = sum(a[:2] == b[:2] for a, b in zip(graphed.pop("first tokens"), eager["first tokens"]))
    return {
        "model": folder,
        "config": dataclasses.asdict(config),
        **graphed,
        "eager mixed decode tok/s": eager["mixed decode tok/s"],
        "graphs vs eager": graphed["mixed decode tok/s"] / eager["mixed decode tok/s"],
        "same as eager": f"{same}/{config.seqs}",
        "first decode token same": f"{first}/{config.seqs}",
    }


def engine_lora(
    folder: str, config: LoraCheckConfig, sizes: str, prompts: list[list[int]], mixed: list[LoRARequest | None]
) -> dict[str, Any]:
    """One engine: decode tok/s of the mixed batch and of the base batch, the mixed batch's tokens, and how its
    decode graphs (if any) ran adapter rows."""
    llm = LLM(
        **engine_args(folder, config, len(prompts), sizes),
        enable_lora=True,
        max_loras=config.adapters,
        max_lora_rank=config.rank,
        worker_backend="inprocess",
    )
    with llm:
        steps = _count_graph_steps(llm)
        base: list[LoRARequest | None] = [None] * len(prompts)
        _timed(llm, prompts, mixed, config.output_len)  # warm-up: adapters load, kernels compile, graphs capture
        _timed(llm, prompts, base, config.output_len)
        result: dict[str, Any] = {}
        for name, loras in (("mixed", mixed), ("base", base)):
            first_s, first = min((_timed(llm, prompts, loras, 2) for _ in range(config.runs)), key=lambda r: r[0])
            total_s, tokens = min(
                (_timed(llm, prompts, loras, config.output_len) for _ in range(config.runs)), key=lambda r: r[0]
            )
            decode = len(prompts) * (config.output_len - 2) / max(total_s - first_s, 1e-9)
            result[f"{name} decode tok/s"] = decode
            if name == "mixed":
                result["tokens"], result["first tokens"] = tokens, first
    result["base vs mixed"] = result["base decode tok/s"] / result["mixed decode tok/s"]
    return {**steps, **result}


def _timed(
    llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def _count_graph_steps(llm: LLM) -> dict[str, Any]:
    """Whether the in-process worker's decode graphs hold LoRA, and (live, filled as the engine runs) how many
    graph-path steps had adapter rows."""
    runner = llm._engine.workers.runners[0]  # type: ignore[union-attr]  # a diagnostic: the worker's own state
    graphs = runner.graphs
    counts: dict[str, Any] = {"graphs with LoRA": graphs is not None and graphs.lora is not None}
    counts["graph steps with adapter rows"] = 0
    if graphs is None:
        return counts
    run = graphs.run

    def counted(*args: Any) -> Any:
        if len(args) > 4 and args[4] is not None:
            counts["graph steps with adapter rows"] += 1
        return run(*args)

    graphs.run = counted
    return counts


def summary_lines(part: dict[str, Any]) -> list[str]:
    if not part or "error" in part:
        return [f"| LoRA in decode graphs | failed: {part['error']} |"] if part else []
    return [
        f"| LoRA in decode graphs | captured with LoRA: {part['graphs with LoRA']}, "
        f"{part['graph steps with adapter rows']} graph steps with adapter rows; tokens same as eager "
        f"{part['same as eager']} (first {part['first decode token same']}) |",
        f"| LoRA decode tok/s | mixed {part['mixed decode tok/s']:.0f}, base {part['base decode tok/s']:.0f} "
        f"(base/mixed {part['base vs mixed']:.2f}x), eager mixed {part['eager mixed decode tok/s']:.0f} "
        f"(graphs {part['graphs vs eager']:.2f}x) |",
    ]
