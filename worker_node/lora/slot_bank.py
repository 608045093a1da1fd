"""LoRA adapters in fixed, preallocated device tensors: the layout a captured CUDA graph can replay.

A graph replays the kernels it recorded, on the memory it recorded: the adapters' weights, the rank each slot
holds and each token's slot must live at addresses that never change, in shapes that never change. So each
projection gets, once, a bank of `max_loras` slots of `max_lora_rank` ranks per HF module it fuses (q/k/v: 3,
gate/up: 2, o and down: 1; `width` columns each), zero-filled:
    a      [max_loras * width, in]    slot s's rows s*width .. s*width + its rank: its A, zeros after
    b      [out, max_loras * width]   the same columns: its B (scale folded in), zeros after
    starts [max_loras]                s * width (never changes)
    widths [max_loras]                the rank slot s holds (0: empty): written in place when a slot is loaded
Loading an adapter into a slot zeroes the slot's columns and copies the adapter into them in place (vLLM's
`set_lora` after `reset_lora` does the same), so a graph captured once keeps computing with whatever adapters
the slots hold at replay. Every token pays for its own adapter's rank only (the Triton kernel reads `widths`), and
a batch's mix of adapters changes nothing but the values of its slot-index buffer: no host sync, no shape that
depends on the batch, no Python branch on which adapters run.

The manager (worker_node/lora/manager.py) uses a bank when the worker captures decode graphs with LoRA on (the
Assignment's max_loras > 0); otherwise it keeps the compact stacks of just the resident adapters' ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_node.lora.weights import PROJECTIONS, LayerLoras, ProjectionLora, projection_shape
from worker_node.models.config import ModelConfig
from worker_node.runtime.parallel import ParallelRank


@dataclass(frozen=True, slots=True)
class LoraCapacity:
    """The adapter slots a worker holds (--max-loras) and the largest rank of an adapter's module (--max-lora-rank)."""

    max_loras: int
    max_rank: int

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError(f"LoRA capacity needs max_loras >= 1 and max_rank >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class BankedProjection:
    """One projection's slots (see the module's docstring): every tensor allocated once, written in place."""

    a: torch.Tensor  # [max_loras * width, in]
    b: torch.Tensor  # [out, max_loras * width]
    starts: torch.Tensor  # [max_loras] int64
    widths: torch.Tensor  # [max_loras] int64
    owner: torch.Tensor  # [max_loras * width] int64: each column's slot (the masked torch path's view)
    width: int  # columns per slot

    def columns(self, slot: int) -> slice:
        return slice(slot * self.width, (slot + 1) * self.width)


class SlotBank:
    def __init__(
        self,
        keys: list[tuple[int, str]],  # (layer of this stage, fused projection) of every adapted projection
        config: ModelConfig,
        where: ParallelRank,
        capacity: LoraCapacity,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.capacity = capacity
        n = capacity.max_loras
        self.projections: dict[tuple[int, str], BankedProjection] = {}
        for key in keys:
            fused = key[1]
            inputs, outputs = projection_shape(fused, config, where)
            width = capacity.max_rank * len(PROJECTIONS[fused][1])
            self.projections[key] = BankedProjection(
                torch.zeros(n * width, inputs, dtype=dtype, device=device),
                torch.zeros(outputs, n * width, dtype=dtype, device=device),
                torch.arange(n, dtype=torch.int64, device=device) * width,
                torch.zeros(n, dtype=torch.int64, device=device),
                torch.arange(n, dtype=torch.int64, device=device).repeat_interleave(width),
                width,
            )

    @property
    def nbytes(self) -> int:
        """Device bytes of the bank: allocated once, whatever the slots hold."""
        return sum(p.a.nbytes + p.b.nbytes for p in self.projections.values())

    def load(self, slot: int, layers: LayerLoras) -> LayerLoras:
        """Copy one adapter into `slot` in place (whatever the slot held is zeroed first); returns the adapter's
        updates as views into the bank, so its weights are held once. ValueError for an adapter that does not fit
        (checked before anything is written: a refused adapter leaves the slot as it was)."""
        if not 0 <= slot < self.capacity.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside the {self.capacity.max_loras} slots of --max-loras")
        for key, update in layers.items():
            proj = self.projections.get(key)
            if proj is None:
                raise ValueError(f"LoRA adapter updates layer {key[0]}'s {key[1]}, which this worker does not adapt")
            rank, inputs = update.a.shape
            if rank > proj.width or inputs != proj.a.shape[1] or tuple(update.b.shape) != (proj.b.shape[0], rank):
                raise ValueError(
                    f"LoRA adapter's layer {key[0]} {key[1]}: A {tuple(update.a.shape)}, B {tuple(update.b.shape)}"
                    f" do not fit its slot (rank <= {proj.width} = --max-lora-rank x fused modules,"
                    f" {proj.a.shape[1]} inputs, {proj.b.shape[0]} outputs)"
                )
        views: LayerLoras = {}
        for key, proj in self.projections.items():
            cols = proj.columns(slot)
            proj.a[cols].zero_()
            proj.b[:, cols].zero_()
            given = layers.get(key)
            rank = 0 if given is None else given.a.shape[0]
            if given is not None:
                start = slot * proj.width
                proj.a[start : start + rank].copy_(given.a)
                proj.b[:, start : start + rank].copy_(given.b)
                views[key] = ProjectionLora(proj.a[start : start + rank], proj.b[:, start : start + rank])
            proj.widths[slot] = rank
        return views

    def clear(self, slot: int) -> None:
        """Empty `slot`: its tokens get no update (width 0, and zeros in its columns)."""
        self.load(slot, {})
