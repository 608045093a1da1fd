"""One step's forward pass on this rank and, on the output rank, its sampling: the hidden states come from the
previous stage (or the embeddings), run through this stage's layers (CUDA graphs for decode-only steps that fit
them, the LoRA slots when a row has an adapter), go to the next stage, and on the last stage become logits and
tokens, prompt logprobs and pooled embeddings. The ModelRunner (worker_node/model_runner.py) is composed of one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from proto.wire import ExecutionMode, TokenLogprobs
from worker_node.batch_rows import RequestState
from worker_node.cuda_graphs import DecodeGraphs
from worker_node.image_embeds import ImageEmbedder
from worker_node.kv.cache import KVCache
from worker_node.lora_holder import LoraHolder
from worker_node.models.decoder import CausalLM
from worker_node.runtime.parallel import Comm
from worker_node.sampler import Drawn, Sampler, token_logprobs
from worker_node.step_inputs import StepGather, StepInputs
from worker_node.step_overlap import DeviceTokens

# Prompt rows scored at once for prompt_logprobs: bounds the [rows, vocab] logits a long prefill chunk would need.
PROMPT_LOGITS_ROWS = 256

Pooled = tuple[int, int, bytes]


@dataclass(slots=True)
class Computed:
    """What one step's forward pass gave this rank. `tokens`: each sampler's token (with one stage every rank
    has them; with more, only the output rank), or DeviceTokens when they stay on the device; `faulted`: the
    handles of the requests whose logits were not finite (on the output rank; DeviceTokens knows them when the
    tokens stay on the device), which fail alone."""

    tokens: list[int] | DeviceTokens
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    pooled: dict[int, Pooled] = field(default_factory=dict)
    faulted: list[int] = field(default_factory=list)


class ForwardPass:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        comm: Comm,
        mode: ExecutionMode,
        sampler: Sampler,
        inputs: StepGather,  # the batch's: each token's LoRA slot
        loras: LoraHolder,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.comm = comm
        self.mode = mode
        self.sampler = sampler
        self.inputs = inputs
        self.loras = loras
        self.dtype = next(model.parameters()).dtype
        self.graphs: DecodeGraphs | None = None  # decode-only steps replay CUDA graphs when set (GPU)
        # A multimodal model's images into its steps' embeddings (worker_node/image_embeds.py), when the loader
        # loaded its vision encoder; None: placeholder tokens are plain tokens (text only).
        self.images: ImageEmbedder | None = None

    def run(self, batch: StepInputs, interrupted: Callable[[], bool] | None, on_device: bool) -> Computed:
        """This rank's stage of the forward pass; the output rank samples. With one stage every rank learns the
        tokens now (`on_device`: where they are, as DeviceTokens, their copy to the host under way); with more,
        only the output rank has them (the others get them with the next plan)."""
        where = self.comm.where
        hidden = self._hidden(batch, interrupted)
        if not where.is_last_stage:
            self.comm.send_to_next_stage(hidden)
        out = Computed([], [None] * len(batch.row_requests))
        drawn: Drawn | None = None
        if where.is_last_stage:
            drawn = self._sample(hidden, batch, on_device, out)
            if batch.prompt_rows:
                out.prompt_logprobs = self._prompt_logprobs(hidden, batch.prompt_rows)
            if batch.pool_rows:
                out.pooled = pool(hidden, batch.pool_rows)
        if self.mode.tokens_in_plan:
            return out
        assert not isinstance(out.tokens, DeviceTokens)
        if on_device:  # (every rank: each embeds them next)
            shared = self.comm.share_sampled_on_device(drawn.tokens if drawn else None, len(batch.row_requests))
            faults = drawn.faulted if drawn is not None else None
            out.tokens, out.faulted = DeviceTokens(shared, faults, batch.row_requests), []
        else:
            out.tokens = self.comm.share_sampled(out.tokens, len(batch.row_requests))
        return out

    def _hidden(self, batch: StepInputs, interrupted: Callable[[], bool] | None) -> torch.Tensor:
        """This stage's hidden states: through CUDA graphs when the step fits them, else the model (with the LoRA
        slots when a row has an adapter)."""
        hidden = None
        if not self.comm.where.is_first_stage:
            shape = (batch.input_ids.shape[0], self.model.config.hidden_size)
            hidden = self.comm.recv_from_previous_stage(shape, self.dtype)
        embedded = bool(batch.image_rows) and self.images is not None and self.comm.where.is_first_stage
        if embedded and self.images is not None:
            hidden = self.images.embed(self.model, batch)  # the image rows' embeddings are the encoder's
        lora = self.loras.manager
        lora_slots = self.inputs.token_lora_slots(batch) if lora is not None else None
        # Graphs read the full pool only; adapter rows replay them when they were captured with LoRA (a slot bank).
        graphs = self.graphs if batch.meta.compact is None and not embedded else None
        if graphs is not None and lora_slots is not None and graphs.lora is None:
            graphs = None
        if graphs is not None and graphs.fits(batch.meta, batch.input_ids.shape[0]):
            return graphs.run(batch.input_ids, batch.positions, batch.meta, hidden, lora_slots)
        if lora_slots is not None and lora is not None:
            with lora.step(lora_slots):
                return self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, hidden, interrupted)
        return self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, hidden, interrupted)

    def _sample(self, hidden: torch.Tensor, batch: StepInputs, on_device: bool, out: Computed) -> Drawn | None:
        """The last stage: the samplers' logits (a TP collective) and their draw; read back to the host into `out`
        (tokens, faulted requests, logprobs) unless the tokens stay on the device."""
        if not batch.samplers:
            return None
        logits = self.model.logits(hidden if batch.all_sample else hidden[batch.sample_rows])
        if logits is None:  # (a TP rank other than the first)
            return None
        drawn = self.sampler.draw(logits, batch.row_requests, batch.row_flags)
        if not on_device:
            tokens, faulted = _to_host(drawn)
            out.tokens, out.faulted = tokens, [batch.row_requests[i].handle for i in faulted]
            out.logprobs = self.sampler.logprobs(logits, tokens, batch.row_requests, batch.row_flags)
        return drawn

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[tuple[RequestState, int, int, int]]
    ) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        """The logprob of each prompt token after the first, from the logits of the row before it: only for the
        requests that asked (the LM head otherwise runs on sampling rows only), in bounded slices of rows."""
        out: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        for state, first_row, count, first in rows:
            k = state.sampling.prompt_logprobs or 0
            chunk: list[TokenLogprobs] = []
            for offset in range(0, count, PROMPT_LOGITS_ROWS):
                n = min(PROMPT_LOGITS_ROWS, count - offset)
                logits = self.model.logits(hidden[first_row + offset : first_row + offset + n])  # TP collective
                if logits is not None:
                    targets = state.token_ids[first + offset : first + offset + n]
                    chunk += token_logprobs(logits, targets, [k] * n)
            if chunk:
                out[state.handle] = (first, chunk)
        return out


def _to_host(drawn: Drawn) -> tuple[list[int], list[int]]:
    """The tokens and the faulted rows' indices, read back in one copy."""
    if drawn.faulted is None:
        return drawn.tokens.tolist(), []
    both = torch.stack((drawn.tokens, drawn.faulted.to(drawn.tokens.dtype))).tolist()
    return both[0], [i for i, bad in enumerate(both[1]) if bad]


def pool(hidden: torch.Tensor, rows: list[tuple[RequestState, int, int, int]]) -> dict[int, Pooled]:
    """Each embedding request's final hidden states of this step, pooled in float32: the sum of its prompt rows
    ("mean": the scheduler adds the chunks up and divides), or its prompt's last row ("last")."""
    out: dict[int, Pooled] = {}
    for state, first_row, count, first in rows:
        states = hidden[first_row : first_row + count].float()
        vector = states.sum(0) if state.sampling.pooling == "mean" else states[-1]
        out[state.handle] = (first, count, vector.cpu().numpy().astype("<f4").tobytes())
    return out
