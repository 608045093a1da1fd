"""The LoRA adapters resident in this worker's slots, and the forward hooks that add each token's adapter to its
projections: many adapters and the base model in one batch.

The host tier (--max-cpu-loras, `LoraAdapter.host_slots`): an adapter evicted from a slot is copied to host memory,
the least recently evicted dropped beyond that many, and a later slot takes it from there instead of its folder
(scheduler_node/core/lora_slots.py keeps the same tier by the same rule, for the memory stats).

The scheduler decides which adapter sits in which slot (`LoraAdapter.slot` on a new request; it never moves an
adapter that a request the workers hold still uses), so every rank of a world holds the same adapters in the same
slots and the worker needs no capacity setting of its own: a slot holding another adapter is reloaded from disk.

The batched segment computation: per fused projection, the resident adapters' A are stacked along the rank
([sum of ranks, in]) and their B beside each other ([out, sum of ranks]); a step's tokens keep only their own
adapter's columns of the shrink, so a projection costs two small matmuls whatever the mix of adapters:
    out += where(mine[token, column], x @ A_stack^T, 0) @ B_stack^T
(tokens of the base model keep no column). Selected, not multiplied by a 0/1 mask: 0 * NaN is NaN, so a non-finite
shrink of one adapter would reach every token of the step. (A non-finite B still would, through the expand: every
adapter is checked finite before it is placed, worker_node/lora/checked_read.py, and the scheduler checked it when
registering it.) The hooks are forward hooks on the base projections, so they compose with any base layer (dense
or quantised) and change no parameter name the loader reads.

An adapter that cannot be placed (its files gone, cut short or changed since the scheduler checked them, or not
finite) raises `AdapterUnusable` and leaves its slot empty, as the scheduler counts it: the slot's last adapter
evicted, the new one not resident (a later request naming it tries its folder again).

With a `LoraCapacity` (a worker that captures decode graphs with LoRA on) the adapters live in a `SlotBank`
instead (worker_node/lora/slot_bank.py): every slot preallocated at --max-lora-rank, loaded in place, and each
projection's update one branch-free computation over all slots, so a captured graph replays it for any mix of
adapters; `bind` points the hooks at the graph runner's static slot-index buffer.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proto.lora import BaseShapes
from proto.wire import LoraAdapter
from worker_node.lora.checked_read import AdapterUnusable, check_finite, read_checked
from worker_node.lora.slot_bank import BankedProjection, LoraCapacity, SlotBank
from worker_node.lora.weights import PROJECTIONS, LayerLoras, ProjectionLora, adapter_updates
from worker_node.models.decoder import CausalLM
from worker_node.runtime.host_copy import to_device

logger = logging.getLogger(__name__)

MAX_RANK = 1024  # the scheduler enforces --max-lora-rank; this only bounds what a worker reads


@dataclass(frozen=True, slots=True)
class ResidentLora:
    id: int
    path: str
    layers: LayerLoras


@dataclass(frozen=True, slots=True)
class Stack:
    """The resident adapters' updates of one projection, side by side; `owner`: each rank column's slot."""

    a: torch.Tensor  # [W, in]
    b: torch.Tensor  # [out, W]
    owner: torch.Tensor  # [W] int64
    key: tuple[tuple[int, int], ...]  # (slot, width) of each adapter in it: masks are shared by equal keys
    spans: dict[int, tuple[int, int]]  # slot -> its columns [start, end)
    starts: torch.Tensor  # [slots] int64: each slot's first column (the Triton kernel's view of `spans`)
    widths: torch.Tensor  # [slots] int64: its width, 0 for a slot without an update of this projection
    max_width: int


class LoraManager:
    def __init__(
        self, model: CausalLM, dtype: torch.dtype, device: torch.device, capacity: LoraCapacity | None = None
    ) -> None:
        self.model = model
        c = model.config
        self.base = BaseShapes(
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
            c.num_layers,
            c.num_experts > 0,
        )
        self.dtype, self.device = dtype, device
        self.slots: dict[int, ResidentLora] = {}
        self.host: OrderedDict[int, LayerLoras] = OrderedDict()  # adapter id -> evicted, in host memory (LRU)
        self.loads = 0  # adapters read from their folders
        self.host_loads = 0  # adapters taken back from the host tier
        self._stacks: dict[tuple[int, str], Stack] = {}
        self._stale = False
        self._token_slots: torch.Tensor | None = None  # this step's slot of each token (-1: the base model)
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # -> [T, W] bool: not the token's column
        self._active: list[int] = []  # this step's slots
        self._row_masks: dict[int, torch.Tensor] = {}  # slot -> [T, 1] bool: the tokens not of that slot
        self._kernel = _triton_kernel() if device.type == "cuda" else None  # on CPU: the masked matmuls below
        projections = [
            ((i, fused), module)
            for i, layer in enumerate(model.layers)
            for fused, (block, _) in PROJECTIONS.items()
            if isinstance(module := getattr(getattr(layer, block, None), fused, None), nn.Module)
        ]
        self._hooks = [module.register_forward_hook(partial(self._hook, key)) for key, module in projections]
        self.bank: SlotBank | None = None  # the graph-safe layout, with a capacity
        if capacity is not None:
            keys = [key for key, _ in projections]
            self.bank = SlotBank(keys, model.config, model.where, capacity, dtype, device)
        self._bank_masks: dict[int, torch.Tensor] = {}  # slot width -> [T, slots * width] bool: not the token's

    def place(self, lora: LoraAdapter) -> None:
        """Make `lora` resident in its slot if the slot holds another adapter: from the host tier, else its folder.
        The adapter it replaces goes to the host tier (`lora.host_slots` of them, the oldest out first).
        AdapterUnusable when its folder no longer holds what the scheduler checked: the slot is then empty."""
        held = self.slots.get(lora.slot)
        if held is not None and held.id == lora.id:
            return
        kept = self.host.pop(lora.id, None)  # before the evicted adapter goes in: it must not push this one out
        if held is not None:
            self._to_host(held, lora.host_slots)
        try:
            layers = self._load(lora, kept)
        except AdapterUnusable:
            self._empty(lora.slot)  # as the scheduler counts it: the last adapter evicted, this one not resident
            raise
        self.slots[lora.slot] = ResidentLora(lora.id, lora.path, layers)

    def _load(self, lora: LoraAdapter, kept: LayerLoras | None) -> LayerLoras:
        """The adapter's updates, from the host tier (`kept`) or its folder, in the bank's slot if there is one."""
        if kept is not None:
            layers = {k: ProjectionLora(p.a.to(self.device), p.b.to(self.device)) for k, p in kept.items()}
            self.host_loads += 1
            where = "host memory"
        else:
            layers = self._read(lora)
            self.loads += 1
            where = lora.path
        if self.bank is not None:  # in place: a captured graph keeps reading the same memory
            try:
                layers = self.bank.load(lora.slot, layers)
            except ValueError as exc:  # it does not fit the slot (checked before anything is written)
                raise AdapterUnusable(lora, str(exc)) from None
        else:
            self._stale = True
        size = sum(p.nbytes for p in layers.values()) / 2**20
        logger.info("LoRA adapter %d loaded into slot %d from %s: %.1f MiB", lora.id, lora.slot, where, size)
        return layers

    def _read(self, lora: LoraAdapter) -> LayerLoras:
        """The adapter's updates from its folder, read whole once and checked (AdapterUnusable)."""
        model = self.model
        info, tensors = read_checked(lora, self.base, MAX_RANK)
        layers = adapter_updates(
            info, tensors, model.config, model.where, model.first_layer, len(model.layers), self.dtype, self.device
        )
        check_finite(lora, layers, model.first_layer)
        return layers

    def _empty(self, slot: int) -> None:
        """The slot holds no adapter (its last one was evicted, the new one could not be read)."""
        if self.slots.pop(slot, None) is None:
            return
        if self.bank is not None:
            self.bank.clear(slot)
        else:
            self._stale = True

    def _to_host(self, held: ResidentLora, host_slots: int) -> None:
        """Copy an evicted adapter to host memory (its layers may be views into the device stacks: copied out)."""
        if host_slots < 1:
            return
        cpu = torch.device("cpu")
        self.host[held.id] = {
            k: ProjectionLora(p.a.to(cpu, copy=True), p.b.to(cpu, copy=True)) for k, p in held.layers.items()
        }
        while len(self.host) > host_slots:
            self.host.popitem(last=False)

    @property
    def host_nbytes(self) -> int:
        return sum(p.nbytes for layers in self.host.values() for p in layers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the resident adapters (in their stacks once a step has run with them; a bank's, all of it)."""
        if self.bank is not None:
            return self.bank.nbytes
        if self._stale:
            return sum(p.nbytes for r in self.slots.values() for p in r.layers.values())
        return sum(s.a.nbytes + s.b.nbytes for s in self._stacks.values())

    @contextmanager
    def step(self, token_slots: np.ndarray) -> Iterator[None]:
        """The forward passes inside see each token's adapter (`token_slots[t]`: its slot, -1 for the base)."""
        if self._stale:
            self._restack()
        self._token_slots = to_device(token_slots, self.device)
        self._active = np.unique(token_slots[token_slots >= 0]).tolist()
        try:
            yield
        finally:
            self._end_step()

    @contextmanager
    def bind(self, token_slots: torch.Tensor) -> Iterator[None]:
        """The forward passes inside read each token's slot from `token_slots` (a device tensor, -1 for the
        base model) when they run: a graph captured inside keeps reading that buffer at every replay."""
        if self.bank is None:
            raise RuntimeError("LoRA in a captured graph needs the slot bank (a LoraCapacity)")
        self._token_slots = token_slots
        try:
            yield
        finally:
            self._end_step()

    def _end_step(self) -> None:
        self._token_slots = None
        self._masks.clear()
        self._row_masks.clear()
        self._bank_masks.clear()

    def _restack(self) -> None:
        """Stack the resident adapters of each projection; each adapter keeps views into its stacks, so its
        weights are held once (one projection's stack more while it is rebuilt)."""
        entries: dict[tuple[int, str], list[tuple[int, ProjectionLora]]] = {}
        for slot in sorted(self.slots):
            for key, update in self.slots[slot].layers.items():
                entries.setdefault(key, []).append((slot, update))
        self._stacks = {k: s for k, s in self._stacks.items() if k in entries}
        for key in list(entries):
            updates = entries.pop(key)  # the old tensors of this projection are freed once it is restacked
            widths = tuple((slot, u.a.shape[0]) for slot, u in updates)
            owner = torch.tensor([slot for slot, w in widths for _ in range(w)], dtype=torch.int64, device=self.device)
            ends = list(itertools.accumulate(w for _, w in widths))
            spans = {slot: (end - w, end) for (slot, w), end in zip(widths, ends)}
            a, b = torch.cat([u.a for _, u in updates]), torch.cat([u.b for _, u in updates], dim=1)
            num = max(spans) + 1
            starts = torch.tensor([spans.get(s, (0, 0))[0] for s in range(num)], dtype=torch.int64)
            lengths = torch.tensor([end - start for start, end in (spans.get(s, (0, 0)) for s in range(num))])
            stack = Stack(
                a, b, owner, widths, spans, starts.to(self.device), lengths.to(self.device), max(w for _, w in widths)
            )
            start = 0
            for slot, width in widths:
                view = ProjectionLora(stack.a[start : start + width], stack.b[:, start : start + width])
                self.slots[slot].layers[key] = view
                start += width
            self._stacks[key] = stack  # the previous stack of this projection is freed here
        self._stale = False

    def _mask(self, stack: Stack) -> torch.Tensor:
        """[T, W]: True where a column of the stack is not the token's adapter's (its shrink is dropped there)."""
        mask = self._masks.get(stack.key)
        if mask is None:
            assert self._token_slots is not None
            mask = self._token_slots[:, None] != stack.owner[None, :]
            self._masks[stack.key] = mask
        return mask

    def _row_mask(self, slot: int) -> torch.Tensor:
        """[T, 1]: True for the tokens of another slot than `slot` (or of the base model)."""
        mask = self._row_masks.get(slot)
        if mask is None:
            assert self._token_slots is not None
            mask = (self._token_slots != slot)[:, None]
            self._row_masks[slot] = mask
        return mask

    def _hook(self, key: tuple[int, str], module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
        if self._token_slots is None:
            return None
        if self.bank is not None:
            banked = self.bank.projections.get(key)
            return None if banked is None else self._banked(banked, args[0], out)
        stack = self._stacks.get(key)
        if stack is None:
            return None
        x = args[0]
        if self._kernel is not None and x.dim() == 2:  # on a GPU: each token reads its own adapter's rows only
            slots = self._token_slots
            return self._kernel(out, x, stack.a, stack.b, slots, stack.starts, stack.widths, stack.max_width)
        # Out of place: a base layer may return a view of a buffer of its own (a quantized kernel's workspace).
        # masked_fill_, not a multiply by 0/1: what another token's adapter computed is replaced, NaN included.
        if 2 * len(self._active) > len(stack.key):  # most resident adapters run: the whole stack at once
            return torch.addmm(out, F.linear(x, stack.a).masked_fill_(self._mask(stack), 0), stack.b.t())
        for slot in self._active:  # a few of many: each one's columns of the stack, not every adapter's
            span = stack.spans.get(slot)
            if span is not None:
                start, end = span
                xa = F.linear(x, stack.a[start:end]).masked_fill_(self._row_mask(slot), 0)
                out = torch.addmm(out, xa, stack.b[:, start:end].t())
        return out

    def _banked(self, proj: BankedProjection, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus each token's update from the bank: the same launches and shapes whatever the batch's adapters
        (padding columns and empty slots hold zeros; a base-model token keeps no column of the shrink)."""
        slots = self._token_slots
        assert slots is not None
        if self._kernel is not None and x.dim() == 2:
            return self._kernel(out, x, proj.a, proj.b, slots, proj.starts, proj.widths, proj.width)
        mask = self._bank_masks.get(proj.width)
        if mask is None:
            mask = slots[:, None] != proj.owner[None, :]
            self._bank_masks[proj.width] = mask
        return torch.addmm(out, F.linear(x, proj.a).masked_fill_(mask, 0), proj.b.t())

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _triton_kernel() -> Any:
    """kernels/triton_lora.py's `lora_add`, or None where Triton is not installed."""
    try:
        from kernels.triton_lora import lora_add
    except ImportError:
        logger.warning("Triton is not installed: LoRA adapters run as masked matmuls")
        return None
    return lora_add
