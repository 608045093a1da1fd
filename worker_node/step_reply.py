"""What a step replies: its tokens recorded in the InputBatch (each sampler's, the accepted proposals', or their
places while they stay on the device) and packed for the wire, with the logprobs, prompt logprobs, pooled
embeddings, proposals and faulted requests beside them; the StepResult assembled from that and the plan's KV moves;
an overlapped step's reply completed once its tokens reach the host. The ModelRunner (worker_node/model_runner.py)
calls these at the end of each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from proto.wire import StepPlan, StepResult, TokenLogprobs, pack_int32
from worker_node.batch_rows import RequestState
from worker_node.forward_pass import Computed, Pooled
from worker_node.input_batch import InputBatch
from worker_node.kv.moves import Moved
from worker_node.spec_decode import accept
from worker_node.step_inputs import StepInputs
from worker_node.step_overlap import DeviceTokens

NON_FINITE = "the model's logits for this request are not finite (NaN or infinity), so no token can be sampled"


@dataclass(slots=True)
class Produced:
    """What a step's compute gave its reply (all empty: it computed nothing here, or it was interrupted)."""

    sampled: dict[int, list[int]] = field(default_factory=dict)  # several tokens a request (speculative decoding)
    token_handles: bytes = b""  # one token each: their requests' handles, packed (StepResult.token_handles) ...
    tokens: bytes = b""  # ... and the tokens, packed (StepResult.tokens) instead of `sampled`
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    pooled: dict[int, Pooled] = field(default_factory=dict)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # a draft model's proposals for the next step
    faulted: list[int] = field(default_factory=list)  # handles of the requests whose logits were not finite
    # Overlapped: the tokens still on the device, and each sampler's place for its token in the batch.
    in_flight: tuple[DeviceTokens, list[tuple[RequestState, int]]] | None = None


def record(batch: InputBatch, inputs: StepInputs, computed: Computed, tokens_in_plan: bool) -> Produced:
    """The step's tokens into the batch (with tokens in plans, P > 1 stages, the next plan brings them instead),
    and what the reply says of them."""
    out = Produced(prompt_logprobs=computed.prompt_logprobs, pooled=computed.pooled, faulted=computed.faulted)
    tokens, lps, samplers = computed.tokens, computed.logprobs, inputs.samplers
    if isinstance(tokens, DeviceTokens):  # overlapped: the rows hold their tokens' places
        out.in_flight = (tokens, batch.reserve(inputs, tokens.tokens))
        out.token_handles = batch.handles(inputs.sampler_rows)
    elif inputs.draft_rows is not None:  # speculative decoding: keep what each sampler's draws accept
        outputs = accept(tokens, inputs.draft_rows) if tokens else []
        if tokens_in_plan:  # the next plan brings the accepted tokens to every rank
            batch.defer_drafts(inputs)
        else:
            batch.append_outputs(inputs, outputs)
        out.sampled = {state.handle: accepted for state, accepted in zip(samplers, outputs)}
        lps = [lps[i] for i in inputs.draft_rows.firsts.tolist()] if lps else lps
    else:
        if not tokens_in_plan:
            batch.append_sampled(inputs, tokens)
        if tokens:  # (a rank of an earlier pipeline stage has none)
            out.token_handles = batch.handles(inputs.sampler_rows)
            out.tokens = pack_int32(tokens)
    if inputs.flags.logprobs.any():
        out.logprobs = {state.handle: [lp] for state, lp in zip(samplers, lps) if lp is not None}
    return out


def reply(
    plan: StepPlan,
    produced: Produced,
    moved: Moved,
    load_skipped: list[int],
    execute_ms: float,
    idle_ms: float,
    interrupted: bool,
) -> StepResult:
    """The step's result, as the wire carries it."""
    return StepResult(
        plan.step_id,
        produced.sampled,
        produced.logprobs,
        execute_ms,
        idle_ms,
        interrupted=interrupted,
        prompt_logprobs=produced.prompt_logprobs,
        pooled=produced.pooled,
        tier_ms=moved.tiers.ms,
        tier_load_ms=moved.tiers.load_ms,
        failed_loads=moved.failed_hashes,
        load_skipped=load_skipped,
        failed_stores=[m.block_hash for m in moved.failed_stores],
        drafts=produced.drafts,
        token_handles=produced.token_handles,
        tokens=produced.tokens,
        faulted=dict.fromkeys(produced.faulted, NON_FINITE),
    )


def finish_overlapped(
    result: StepResult,
    start: float,
    batch: InputBatch,
    tokens: DeviceTokens,
    places: list[tuple[RequestState, int]],
) -> StepResult:
    """An overlapped step's reply, once its tokens reach the host; they take their places in the batch. Its
    execute_ms runs to then: the launch alone would say nothing of the device's time (preemption weighs it)."""
    values = tokens.values()
    result.faulted = dict.fromkeys(tokens.faulted_handles(), NON_FINITE)
    result.execute_ms = (time.perf_counter() - start) * 1e3
    batch.fill(places, values, tokens.tokens)
    result.tokens = pack_int32(values)
    return result
