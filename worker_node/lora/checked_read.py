"""An adapter read for a worker's slot: its files read whole, once, checked against the checksum the scheduler took
when it registered them, parsed from those bytes and checked again (shapes, finite values, in the serving dtype
too), so what runs is what was checked, whatever happened to the folder since (a file cut short, changed, deleted).

A failure is an `AdapterUnusable` naming the adapter by its served name and id: the requests naming it fail with
that reason (worker_node/plan_diffs.py raises the RequestFault), which their clients see, so the server's paths
stay in this worker's log.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from proto.lora import WEIGHTS_FILE, AdapterError, AdapterInfo, BaseShapes, check_adapter, read_adapter_files
from proto.wire import LoraAdapter
from worker_node.lora.weights import LayerLoras

logger = logging.getLogger(__name__)


class AdapterUnusable(Exception):
    """This adapter cannot be used: `reason` names it by name and id, never by its path."""

    def __init__(self, lora: LoraAdapter, detail: str) -> None:
        self.lora_id = lora.id
        self.reason = f"LoRA adapter {describe(lora)} cannot be used: {detail}"
        super().__init__(self.reason)


def describe(lora: LoraAdapter) -> str:
    return f"{lora.name!r} (id {lora.id})" if lora.name else f"id {lora.id}"


def read_checked(lora: LoraAdapter, base: BaseShapes, max_rank: int) -> tuple[AdapterInfo, dict[str, torch.Tensor]]:
    """The adapter's checked tensors (on the host, as its file stores them), read from its folder once."""
    folder = Path(lora.path)
    try:
        files = read_adapter_files(folder)
        if lora.sha256 and files.sha256 != lora.sha256:
            logger.warning(
                "LoRA adapter %s at %s: sha256 %s, registered as %s", describe(lora), folder, files.sha256, lora.sha256
            )
            raise AdapterUnusable(lora, "its files changed since it was loaded (another checksum); load it again")
        info = check_adapter(folder, files, base, max_rank)
        tensors = load_safetensors(files.weights)
    except AdapterError as exc:
        logger.warning("LoRA adapter %s: %s", describe(lora), exc)  # with the path: for the operator
        raise AdapterUnusable(lora, exc.detail) from None
    except SafetensorError as exc:  # checked above as safetensors reads it: only a disagreement on the format
        logger.warning("LoRA adapter %s: %s: %s", describe(lora), folder / WEIGHTS_FILE, exc)
        raise AdapterUnusable(lora, f"{WEIGHTS_FILE} cannot be parsed ({exc})") from None
    return info, tensors


def check_finite(lora: LoraAdapter, layers: LayerLoras, first_layer: int = 0) -> None:
    """Every update is finite as it will run: in the serving dtype, with the scale folded into B (a value that is
    finite in the file may overflow float16). One device sync for all of them. `first_layer`: this stage's."""
    if not layers:
        return
    finite = torch.stack([torch.isfinite(p.a).all() & torch.isfinite(p.b).all() for p in layers.values()])
    if bool(finite.all()):
        return
    layer, fused = next(k for k, p in layers.items() if not (torch.isfinite(p.a).all() and torch.isfinite(p.b).all()))
    dtype = str(layers[(layer, fused)].a.dtype).removeprefix("torch.")
    where = f"layer {first_layer + layer} {fused}"
    raise AdapterUnusable(lora, f"{where}: its update is not finite in {dtype} (scaled by lora_alpha)")
