"""CUDA graphs for decode-only steps: the GPU path's answer to kernel-launch overhead (CPU runs eagerly).

A decode step of a given batch size launches the same kernels every time, so each size in `sizes` is captured
once at start-up and replayed; a batch is padded up to the nearest captured size. Inputs live in static
buffers: padding tokens get slot -1 (the Triton write_kv kernel skips them), an all-zero block table row and a
sequence length of 1, and their outputs are dropped. The block table is always `max_blocks` wide, which the
split-KV decode kernel sizes its segments from without a device sync.

Used only where it is safe: a CUDA device, the Triton backend (the torch reference cannot skip slot -1), and
one GPU per stage (TP 1: collectives inside a graph need NCCL graph capture, not set up here). The GPU capture
itself is not exercised by the CPU test suite; `capture=False` runs the same padded buffers eagerly, which is
how tests/kernels/test_decode_graphs.py checks the padding on CPU under Triton's interpreter.

LoRA (`lora`, a manager with a slot bank: worker_node/lora/slot_bank.py): each token's adapter slot is one more
static buffer (-1 for the base model and for padding), bound to the manager's hooks while a size is captured, so
the graphs hold the adapters' kernels over the bank's fixed tensors and replay for any mix of adapters and base
rows; a batch of base rows only replays the same graph with every slot -1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from worker_node.kv.cache import KVCache
from worker_node.lora.manager import LoraManager
from worker_node.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]  # model(input_ids, positions, kv_caches, meta, hidden) -> hidden


def parse_sizes(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; '' -> [] (graphs off)."""
    sizes = sorted({int(x) for x in str(text).split(",") if x.strip()})
    if any(s < 1 for s in sizes):
        raise ValueError(f"CUDA graph sizes must be >= 1, got {text!r}")
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: Forward,
        kv_cache: KVCache,
        sizes: list[int],
        max_blocks: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        takes_hidden: bool,  # a pipeline stage after the first: its input is the previous stage's output
        capture: bool = True,
        lora: LoraManager | None = None,  # LoRA on: its slot bank's updates are captured too
    ) -> None:
        if not sizes:
            raise ValueError("no CUDA graph sizes")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.capture_graphs = capture
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device) if takes_hidden else None
        if lora is not None and lora.bank is None:
            raise ValueError("LoRA in decode graphs needs the manager's slot bank (a LoraCapacity)")
        self.lora = lora
        self.lora_slots = torch.full((n,), -1, dtype=torch.int64, device=device) if lora is not None else None
        self._no_prefill = (
            torch.zeros((0, max_blocks), dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only batch no larger than the largest captured size, whose tables fit the static width."""
        return (
            meta.num_decode_tokens == num_tokens <= self.sizes[-1]
            and meta.decode_block_tables.shape[1] <= self.max_blocks
        )

    def _args(self, size: int) -> tuple:  # type: ignore[type-arg]
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            prefill_block_tables=self._no_prefill[0],
            prefill_cu_seqlens_q=self._no_prefill[1],
            prefill_seq_lens=self._no_prefill[2],
        )
        hidden = None if self.hidden is None else self.hidden[:size]
        return self.input_ids[:size], self.positions[:size], self.kv_cache, meta, hidden

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the static buffers of `size` rows (what a graph of that size records)."""
        if self.lora is None or self.lora_slots is None:
            return self.model(*self._args(size))
        with self.lora.bind(self.lora_slots[:size]):
            return self.model(*self._args(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all sharing one memory pool."""
        if not self.capture_graphs:
            return
        pool = None
        for size in reversed(self.sizes):
            for _ in range(2):  # warm-up: autotuning and lazy allocations happen outside the capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        with_lora = " with LoRA" if self.lora is not None else ""
        logger.info("captured decode CUDA graphs%s for batch sizes %s", with_lora, self.sizes)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None,
        lora_slots: np.ndarray | None = None,  # each token's LoRA slot (-1: the base model); None: all base
    ) -> torch.Tensor:
        """The model's output for a decode-only batch (`fits` must hold), replayed at the nearest size."""
        n = input_ids.shape[0]
        if lora_slots is not None and self.lora_slots is None:
            raise ValueError("a batch with LoRA adapters, but the decode graphs were captured without LoRA")
        size = next(s for s in self.sizes if s >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.block_tables[:n, width:].zero_()
        self.block_tables[n:size].zero_()
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:size].fill_(1)
        if self.hidden is not None and hidden is not None:
            self.hidden[:n].copy_(hidden)
        if self.lora_slots is not None:
            if lora_slots is None:
                self.lora_slots[:size].fill_(-1)
            else:
                self.lora_slots[:n].copy_(torch.from_numpy(lora_slots), non_blocking=True)  # (host_copy.py)
                self.lora_slots[n:size].fill_(-1)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]  # capture=False: the same padded buffers, eagerly
