"""Sampling: greedy, temperature, top-k, top-p, and per-request seeds that survive batching and preemption.

Every row of the batch is handled by the same tensor operations: no loop over requests. A sampled row draws one
uniform number and inverts its filtered distribution's CDF (one cumsum and one searchsorted for the whole
batch). A seeded row's number comes from a hash of (seed, output position), so the same request draws the same
token at the same position in any batch, on any worker, after any preemption; other rows take theirs from
torch's generator.
"""

from __future__ import annotations

import torch

from proto.wire import SamplingOptions, TokenLogprobs

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (seed, position): splitmix64 of the two, 53 bits kept."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def sample(
    logits: torch.Tensor,  # [B, V] float32
    options: list[SamplingOptions],
    positions: list[int],  # output index each row samples (for seeded rows)
) -> tuple[list[int], list[TokenLogprobs | None]]:
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, o in enumerate(options) if not o.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        chosen = [options[i] for i in random_rows]
        probs = _filtered_probs(logits[rows], chosen)
        drawn = torch.rand(len(random_rows), dtype=torch.float64).tolist()  # unseeded rows: torch's generator
        uniforms = [
            drawn[j] if o.seed is None else seeded_uniform(o.seed, positions[i])
            for j, (i, o) in enumerate(zip(random_rows, chosen))
        ]
        tokens[rows] = _inverse_cdf(probs, torch.tensor(uniforms, dtype=torch.float64, device=logits.device))
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, options, token_list)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row whose CDF interval holds that row's uniform (never one of probability 0)."""
    cdf = probs.double().cumsum(dim=-1)  # float64: the last of 50k+ summands still moves the sum
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _filtered_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    temps = torch.tensor([o.temperature for o in options], device=logits.device).unsqueeze(1)
    logits = logits / temps
    top_ks = [o.top_k for o in options]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_ps = [o.top_p for o in options]
    if any(p < 1.0 for p in top_ps):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        ps = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(before >= ps, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


def _logprobs(logits: torch.Tensor, options: list[SamplingOptions], tokens: list[int]) -> list[TokenLogprobs | None]:
    wanted = [i for i, o in enumerate(options) if o.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(options)
    if not wanted:
        return out
    rows = torch.tensor(wanted, device=logits.device)
    logp = logits[rows].log_softmax(dim=-1)
    picked = logp.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=logits.device)).flatten().tolist()
    max_k = max(options[i].logprobs or 0 for i in wanted)
    top_v, top_i = logp.topk(max_k, dim=-1) if max_k else (logp[:, :0], logp[:, :0].long())
    top_values, top_ids = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(wanted):
        k = options[i].logprobs or 0
        out[i] = TokenLogprobs(picked[j], list(zip(top_ids[j][:k], top_values[j][:k])))
    return out
