"""The rows of the InputBatch (worker_node/input_batch.py): one preallocated array per fact of a held request, a
row each, and the room in them. The InputBatch owns them and writes them (a plan's diffs, a step's tokens); the
StepGather it is composed of (worker_node/step_inputs.py) reads a step's rows from them and advances their computed
tokens. The arrays double when a request outgrows them and keep their peak size, so a reader must look them up here
each time, never keep one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from proto.multimodal import ImageInput
from proto.wire import SamplingOptions

_ROW_ARRAYS = (
    "token_ids", "num_tokens", "num_computed", "num_prompt", "block_table", "num_blocks", "wants_prompt_logprobs",
    "plain", "on_device", "wants_logprobs", "pools", "has_images", "num_drafts", "num_unverified", "lora_slot",
    "handle", "held",
)  # fmt: skip


@dataclass(slots=True)
class RequestState:
    """What the worker keeps of a request besides its row's arrays (what the sampler reads, see SamplingRequest)."""

    handle: int  # the request's id on the wire
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling: SamplingOptions
    row: int  # its row in the InputBatch
    resumed: bool = False  # came back with output tokens: its prompt logprobs were delivered already
    images: tuple[
        ImageInput, ...
    ] = ()  # its images: their embeddings replace their placeholder tokens' (a LLaVA model)


class BatchRows:
    def __init__(self, rows: int) -> None:
        self.owners: list[RequestState | None] = [None] * rows  # by row
        self.token_ids = np.zeros((rows, 256), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.num_prompt = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, 16), dtype=np.int32)  # past num_blocks: zeros (the tables' padding)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.wants_prompt_logprobs = np.zeros(rows, dtype=bool)
        self.plain = np.zeros(rows, dtype=bool)  # the sampler's RowFlags
        self.on_device = np.zeros(rows, dtype=bool)  # its token needs nothing of the host (sampler.runs_on_device)
        self.wants_logprobs = np.zeros(rows, dtype=bool)
        self.pools = np.zeros(rows, dtype=bool)  # an embedding request
        self.has_images = np.zeros(rows, dtype=bool)  # its prompt holds images (worker_node/image_embeds.py)
        self.lora_slot = np.zeros(rows, dtype=np.int64)  # its LoRA adapter's slot + 1 (0: the base model)
        self.num_drafts = np.zeros(rows, dtype=np.int64)  # proposals held past num_tokens for this step only
        # Tokens in plans (P > 1 stages): proposals computed in the last step that included the row, counted as
        # computed until the next plan that includes it says how many were accepted (InputBatch.settle_unverified).
        self.num_unverified = np.zeros(rows, dtype=np.int64)
        self.handle = np.zeros(rows, dtype=np.int64)  # the request's handle
        self.held = np.zeros(rows, dtype=bool)  # the row is a request's
        # The tokens of the last step launched before the host read them (worker_node/step_overlap.py): until then
        # its samplers' rows hold a placeholder -(i + 1) for token i of this tensor, which a gather reads here.
        self.in_flight: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.owners)

    def fit(self, tokens: int, blocks: int) -> None:
        """Room for `tokens` token ids and `blocks` blocks in every row (doubling)."""
        if tokens > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, tokens)
        if blocks > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, blocks)

    def grow(self) -> range:
        """Twice the rows; the new ones, empty."""
        old = len(self.owners)
        new = 2 * old
        self.owners += [None] * (new - old)
        for name in _ROW_ARRAYS:
            array = getattr(self, name)
            grown = np.zeros((new, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        return range(old, new)


def _widen(array: np.ndarray, width: int) -> np.ndarray:
    new = max(width, 2 * array.shape[1])
    grown = np.zeros((array.shape[0], new), dtype=array.dtype)
    grown[:, : array.shape[1]] = array
    return grown
