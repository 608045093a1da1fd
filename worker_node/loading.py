"""One rank, ready to run plans: its model shard, its KV cache and swap space, sized as the assignment says.

Shared by the worker process (worker_node/worker.py) and the in-process transport (worker_node/inprocess.py), so
both build a rank the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from kernels import cpu_gemm, cpu_isa
from kernels.backend import check_cache_dtype, check_reads_quantized, select_attention_backend
from kernels.cpu_features import has_fast_bf16
from kernels.interface import AttentionBackend
from kernels.kv_quant import cache_dtype, format_name, is_quantized
from kernels.openmp import release_thread_pool
from proto.wire import Assignment, WorkerReady
from settings.fast_paths import FastPaths
from settings.worker import WorkerOptions
from worker_node.cuda_graphs import DecodeGraphs, parse_sizes
from worker_node.draft_model import load_draft
from worker_node.image_embeds import load_image_embedder
from worker_node.kv.cache import (
    KVCache,
    allocate_host_cache,
    allocate_kv_cache,
    attach_compact,
    bytes_per_block,
    kv_cache_budget,
    kv_cache_limit,
    measure_swap_bandwidth,
)
from worker_node.kv.tiers import DiskLayout, DiskTier, KVOffload, model_fingerprint
from worker_node.lora.manager import LoraManager
from worker_node.lora.slot_bank import LoraCapacity
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig
from worker_node.models.decoder import CausalLM
from worker_node.models.layers import set_batch_invariant
from worker_node.models.loader import load_model
from worker_node.models.quant_int8 import set_act_bits
from worker_node.runtime.parallel import Comm, ParallelRank
from worker_node.step_overlap import overlaps_on

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on GPUs and on CPUs with bf16 dot-product instructions (AVX-512 BF16, AMX), float32 on
    other CPUs.

    No float32 copy of the weights is kept for small steps: on a 2-core Zen 4 one decoder layer's linears ran
    1.04x (1 row) to 2.5x (16-32 rows) faster in bf16 than in float32 with one thread, 1.5-3.2x with two, and
    the LM head 1.5-3.7x (scripts/bench_cpu_dtypes.py, docs/benchmarks.md)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or has_fast_bf16() else torch.float32
    return DTYPES[name]


def shard_config(config: ModelConfig, where: ParallelRank) -> ModelConfig:
    """The model as one rank holds it: its stage's layers and its KV heads (what its KV cache is sized for)."""
    from proto.parallel import kv_head_range

    start, end = where.layout.layer_range(where.stage, config.num_layers)
    kv0, kv1 = kv_head_range(config.num_kv_heads, where.tp_size, where.tp_rank)
    return dataclasses.replace(config, num_layers=end - start, num_kv_heads=kv1 - kv0)


def kv_blocks_to_allocate(assigned: int, block_bytes: int, budget: int, limit: int) -> int:
    """The first world sizes itself from its budget; a replacement takes exactly the world's size, unless its
    memory truly cannot hold it (then as many as fit, and the scheduler shrinks the world to that)."""
    if assigned <= 0:
        return budget // block_bytes
    fits = limit // block_bytes
    if fits < assigned:
        logger.warning("told to hold %d KV blocks, but only %d fit in this worker's memory", assigned, fits)
        return fits
    return assigned


@dataclass
class Caches:
    """A rank's KV memory: the device cache (with its compact pool when there is one) and the host swap space."""

    device: KVCache
    num_blocks: int
    block_bytes: int
    host: KVCache
    swap_blocks: int
    compact_blocks: int = 0
    compact_bytes: int = 0


def load_rank(
    a: Assignment, options: WorkerOptions, device: torch.device, comm: Comm
) -> tuple[ModelRunner, WorkerReady]:
    """Load this rank's shard and size its caches; the runner and the Ready message that reports them."""
    fast = options.fast_paths
    set_kernel_switches(fast)
    dtype = pick_dtype(a.dtype, device)
    where = comm.where
    full = ModelConfig.from_folder(a.model)
    config = shard_config(full, where)  # what this rank's KV cache holds: its layers, its KV heads
    backend = select_attention_backend(options.attention_backend, device)
    kv_dtype = cache_dtype(options.kv_cache_dtype, dtype)
    compact_dtype = cache_dtype(a.kv_compact_dtype, dtype) if a.kv_compact_fraction > 0 else None
    _check_kv_formats(backend, device, kv_dtype, compact_dtype)
    model = load_model(
        a.model, backend, dtype, device, full.max_model_len, where, comm, a.quantization, huge_pages=fast.huge_pages
    )
    images = load_image_embedder(
        a.model, a.extra_modules, dtype, device, where.is_first_stage, options.encoder_cache_memory
    )
    set_batch_invariant(model, options.batch_invariant)
    model.use_native_decode(fast.native_decode, fast.decode_phases)
    # Before the KV cache is sized: the LoRA slot bank's bytes come out of its budget.
    graph_lora = lora_for_graphs(a, options, backend.name, model, dtype, device, where)
    caches = allocate_caches(a, options, config, device, comm, kv_dtype, compact_dtype)
    tokenizer = Path(a.model) / "tokenizer.json"
    offload = build_offload(options, a, config, kv_dtype, device, caches.block_bytes)
    runner = ModelRunner(
        model,
        caches.device,
        a.block_size,
        device,
        caches.host,
        comm,
        a.mode,
        tokenizer if tokenizer.is_file() else None,
        offload,
        overlaps_on(options.overlap_steps, device),
    )
    runner.lora = graph_lora
    runner.forward.images = images
    enable_decode_graphs(runner, options.cuda_graph_sizes, backend.name, full.max_model_len)
    if a.draft_model and runner.samples_here:  # the draft runs where the tokens are sampled (draft_model.py)
        runner.draft = load_draft(
            a.draft_model,
            full.vocab_size,
            backend,
            dtype,
            device,
            full.max_model_len,
            a.block_size,
            a.num_speculative_tokens,
            a.draft_max_seqs,
            fast.huge_pages,
        )
        runner.draft.model.use_native_decode(fast.native_decode, fast.decode_phases)
    bandwidth = measure_swap_bandwidth(caches.device, caches.host, caches.block_bytes)
    release_thread_pool()  # the step thread runs the model; this one's OpenMP workers would slow it (kernels/openmp.py)
    ready = _ready(a.rank, caches, bandwidth, kv_dtype, compact_dtype)
    return runner, offload.report(ready) if offload is not None else ready


def _check_kv_formats(
    backend: AttentionBackend, device: torch.device, kv_dtype: torch.dtype, compact_dtype: torch.dtype | None
) -> None:
    """The backend reads the cache's format, and the compact pool's (ValueError naming what it cannot)."""
    check_cache_dtype(backend, kv_dtype)
    if is_quantized(kv_dtype):
        check_reads_quantized(backend, kv_dtype, device)
    if compact_dtype is not None:
        check_cache_dtype(backend, compact_dtype)
        check_reads_quantized(backend, compact_dtype, device)


def allocate_caches(
    a: Assignment,
    options: WorkerOptions,
    config: ModelConfig,
    device: torch.device,
    comm: Comm,
    kv_dtype: torch.dtype,
    compact_dtype: torch.dtype | None,
) -> Caches:
    """The device cache sized from the memory this rank may use (less the compact pool's share), the compact pool
    in what is left, and the host swap space (never more blocks than the world's size says)."""
    block_bytes = bytes_per_block(config, a.block_size, kv_dtype)
    budget = kv_cache_budget(device, options.kv_cache_memory, options.gpu_memory_utilization, comm.ranks_on_host)
    limit = kv_cache_limit(device, options.kv_cache_memory, options.gpu_memory_utilization)
    compact_budget = int(budget * a.kv_compact_fraction)  # the compact pool's share (per-request KV precision)
    num_blocks = kv_blocks_to_allocate(a.num_kv_blocks, block_bytes, budget - compact_budget, limit)
    cache = allocate_kv_cache(config, a.block_size, kv_dtype, device, num_blocks)
    compact_blocks, compact_bytes = 0, 0
    if compact_dtype is not None:
        compact_bytes = bytes_per_block(config, a.block_size, compact_dtype)
        room = limit - num_blocks * block_bytes
        compact_blocks = kv_blocks_to_allocate(a.num_compact_blocks, compact_bytes, compact_budget, room)
        cache = attach_compact(cache, allocate_kv_cache(config, a.block_size, compact_dtype, device, compact_blocks))
    swap_blocks = int(options.swap_space * 2**30) // block_bytes
    if a.num_swap_blocks >= 0:  # the world's size: never more (its flag is the limit it may take)
        swap_blocks = min(swap_blocks, a.num_swap_blocks)
    host = allocate_host_cache(config, a.block_size, kv_dtype, device, swap_blocks)
    return Caches(cache, num_blocks, block_bytes, host, swap_blocks, compact_blocks, compact_bytes)


def _ready(
    rank: int, caches: Caches, bandwidth: float, kv_dtype: torch.dtype, compact_dtype: torch.dtype | None
) -> WorkerReady:
    ready = WorkerReady(
        rank, caches.num_blocks, caches.num_blocks * caches.block_bytes, caches.swap_blocks, bandwidth,
        format_name(kv_dtype),
    )  # fmt: skip
    if compact_dtype is None:
        return ready
    return msgspec.structs.replace(
        ready,
        num_compact_blocks=caches.compact_blocks,
        compact_cache_bytes=caches.compact_blocks * caches.compact_bytes,
        compact_format=format_name(compact_dtype),
    )


def set_kernel_switches(fast: FastPaths) -> None:
    """The CPU kernels' module-level switches, set as a rank loads (what is loaded from then on follows them): the C
    matmul kernels on or off, the int8 kernel's activation bits (settings/fast_paths.py)."""
    cpu_gemm.set_enabled(fast.cpu_gemm)
    cpu_isa.set_ceiling(fast.cpu_isa)
    set_act_bits(fast.int8_act_bits)


def build_offload(
    options: WorkerOptions,
    a: Assignment,
    config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    block_bytes: int,
) -> KVOffload | None:
    """This rank's KV offload tiers as its flags size them (None without any), in the KV cache's own format."""
    ram_slots = int(options.kv_offload_ram * 2**30) // block_bytes
    disk = None
    if options.kv_offload_disk:
        layout = DiskLayout(
            model_fingerprint(a.model),
            format_name(kv_dtype),
            a.block_size,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            a.rank,
            a.tensor_parallel_size,
            a.pipeline_parallel_size,
            num_slots=0,
            payload_bytes=block_bytes,
        )
        slots = int(options.kv_offload_disk_size * 2**30) // layout.record_bytes
        if slots > 0:
            layout = dataclasses.replace(layout, num_slots=slots)
            disk = DiskTier(Path(options.kv_offload_disk) / f"rank{a.rank}.kvtier", layout)
    if not ram_slots and disk is None:
        return None
    return KVOffload(allocate_host_cache(config, a.block_size, kv_dtype, device, ram_slots) if ram_slots else [], disk)


def graphs_apply(
    sizes_text: str, backend_name: str, device: torch.device, where: ParallelRank, warn: bool = True
) -> bool:
    """Decode graphs are asked for and safe here: CUDA, the Triton backend, TP 1."""
    if not parse_sizes(sizes_text) or device.type != "cuda":
        return False
    if where.tp_size > 1 or backend_name != "triton":
        if warn:
            logger.warning(
                "CUDA graphs need TP 1 and the triton backend (TP %d, %s): running eagerly", where.tp_size, backend_name
            )
        return False
    return True


def lora_for_graphs(
    a: Assignment,
    options: WorkerOptions,
    backend_name: str,
    model: CausalLM,
    dtype: torch.dtype,
    device: torch.device,
    where: ParallelRank,
) -> LoraManager | None:
    """With LoRA on and decode graphs to capture: the LoRA manager over a slot bank of the Assignment's capacity,
    whose updates the graphs capture (worker_node/lora/slot_bank.py); else None (made on first use, compact)."""
    if a.max_loras < 1 or a.max_lora_rank < 1:
        return None
    if not graphs_apply(options.cuda_graph_sizes, backend_name, device, where, warn=False):
        return None
    return LoraManager(model, dtype, device, LoraCapacity(a.max_loras, a.max_lora_rank))


def enable_decode_graphs(runner: ModelRunner, sizes_text: str, backend_name: str, max_model_len: int) -> None:
    """Capture decode graphs for `runner` when asked and safe (CUDA, Triton, TP 1); else leave it eager. With a
    LoRA manager over a slot bank (`runner.lora`), the graphs capture the adapters' updates too."""
    where = runner.comm.where
    if not graphs_apply(sizes_text, backend_name, runner.device, where):
        return
    sizes = parse_sizes(sizes_text)
    num_blocks = runner.num_blocks
    max_blocks = min(num_blocks, -(-max_model_len // runner.block_size))
    config = runner.model.config
    lora = runner.lora if runner.lora is not None and runner.lora.bank is not None else None
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.kv_cache,
        sizes,
        max_blocks,
        config.hidden_size,
        runner.dtype,
        runner.device,
        takes_hidden=not where.is_first_stage,
        lora=lora,
    )
    runner.graphs.capture()
