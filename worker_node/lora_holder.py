"""Where a worker's LoRA manager (worker_node/lora/manager.py) lives: made when the first request with an adapter
arrives, or attached by the loader before (a slot bank the CUDA graphs capture: worker_node/loading.py). The
ModelRunner owns it and hands it to the two objects that use it: the plan's diffs place each new request's adapter
(worker_node/plan_diffs.py), the forward pass runs the rows with theirs (worker_node/forward_pass.py)."""

from __future__ import annotations

import torch

from proto.wire import LoraAdapter
from worker_node.lora.manager import LoraManager
from worker_node.models.decoder import CausalLM


class LoraHolder:
    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.manager: LoraManager | None = None  # None until a request brings an adapter (LoRA costs nothing then)

    def made(self) -> LoraManager:
        """The manager, made on first use."""
        if self.manager is None:
            self.manager = LoraManager(self.model, self.dtype, self.device)
        return self.manager

    def place(self, lora: LoraAdapter) -> None:
        """A new request's adapter in a slot (loaded, or already resident)."""
        self.made().place(lora)
