"""The LoRA adapters resident in this worker's slots, and the forward hooks that add each token's adapter to its
projections: many adapters and the base model in one batch.

The scheduler decides which adapter sits in which slot (`LoraAdapter.slot` on a new request; it never moves an
adapter that a request the workers hold still uses), so every rank of a world holds the same adapters in the same
slots and the worker needs no capacity setting of its own: a slot holding another adapter is reloaded from disk.

The batched segment computation: per fused projection, the resident adapters' A are stacked along the rank
([sum of ranks, in]) and their B beside each other ([out, sum of ranks]); a step's tokens see only their own
adapter's columns through a 0/1 mask, so a projection costs two small matmuls whatever the mix of adapters:
    out += ((x @ A_stack^T) * mask[token, column]) @ B_stack^T
(tokens of the base model have an all-zero mask row). The hooks are forward hooks on the base projections, so they
compose with any base layer (dense or quantised) and change no parameter name the loader reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proto.lora import BaseShapes, inspect_adapter
from proto.wire import LoraAdapter
from worker_node.lora.weights import PROJECTIONS, LayerLoras, read_adapter
from worker_node.models.decoder import CausalLM

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


class LoraManager:
    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
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
        self.loads = 0
        self._stacks: dict[tuple[int, str], Stack] = {}
        self._stale = False
        self._token_slots: torch.Tensor | None = None  # this step's slot of each token (-1: the base model)
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
        self._hooks = [
            module.register_forward_hook(partial(self._hook, (i, fused)))
            for i, layer in enumerate(model.layers)
            for fused, (block, _) in PROJECTIONS.items()
            if isinstance(module := getattr(getattr(layer, block, None), fused, None), nn.Module)
        ]

    def place(self, lora: LoraAdapter) -> None:
        """Make `lora` resident in its slot, reading it from disk if the slot holds another adapter."""
        held = self.slots.get(lora.slot)
        if held is not None and held.id == lora.id:
            return
        info = inspect_adapter(lora.path, self.base, MAX_RANK)
        model = self.model
        layers = read_adapter(
            info, model.config, model.where, model.first_layer, len(model.layers), self.dtype, self.device
        )
        self.slots[lora.slot] = ResidentLora(lora.id, lora.path, layers)
        self._stale = True
        self.loads += 1
        logger.info("LoRA adapter %d (%s) loaded into slot %d", lora.id, lora.path, lora.slot)

    @property
    def nbytes(self) -> int:
        """Bytes of the resident adapters and of their stacks."""
        own = sum(p.nbytes for r in self.slots.values() for p in r.layers.values())
        return own + sum(s.a.nbytes + s.b.nbytes for s in self._stacks.values())

    @contextmanager
    def step(self, token_slots: np.ndarray) -> Iterator[None]:
        """The forward passes inside see each token's adapter (`token_slots[t]`: its slot, -1 for the base)."""
        if self._stale:
            self._restack()
        self._token_slots = torch.from_numpy(token_slots).to(self.device)
        try:
            yield
        finally:
            self._token_slots = None
            self._masks.clear()

    def _restack(self) -> None:
        stacks: dict[tuple[int, str], list[tuple[int, Any]]] = {}
        for slot in sorted(self.slots):
            for key, update in self.slots[slot].layers.items():
                stacks.setdefault(key, []).append((slot, update))
        self._stacks = {}
        for key, entries in stacks.items():
            widths = tuple((slot, u.a.shape[0]) for slot, u in entries)
            owner = torch.tensor([slot for slot, w in widths for _ in range(w)], dtype=torch.int64, device=self.device)
            a = torch.cat([u.a for _, u in entries])
            b = torch.cat([u.b for _, u in entries], dim=1)
            self._stacks[key] = Stack(a, b, owner, widths)
        self._stale = False

    def _mask(self, stack: Stack) -> torch.Tensor:
        mask = self._masks.get(stack.key)
        if mask is None:
            assert self._token_slots is not None
            mask = (self._token_slots[:, None] == stack.owner[None, :]).to(self.dtype)
            self._masks[stack.key] = mask
        return mask

    def _hook(self, key: tuple[int, str], module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
        if self._token_slots is None:
            return None
        stack = self._stacks.get(key)
        if stack is None:
            return None
        # Out of place: a base layer may return a view of a buffer of its own (a quantized kernel's workspace).
        return torch.addmm(out, F.linear(args[0], stack.a).mul_(self._mask(stack)), stack.b.t())

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
