"""Sampling: greedy, temperature, top-k, top-p, and per-request seeds that survive batching and preemption."""

from __future__ import annotations

import torch

from proto.wire import SamplingOptions, TokenLogprobs

_SEED_MIX = 0x9E3779B97F4A7C15


def step_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator for one output position: the same (seed, position) draws the same noise in any batch."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + position) % (2**63))
    return g


def sample(
    logits: torch.Tensor,  # [B, V] float32
    options: list[SamplingOptions],
    positions: list[int],  # output index each row samples (for seeded rows)
) -> tuple[list[int], list[TokenLogprobs | None]]:
    greedy = logits.argmax(dim=-1)
    tokens = greedy.clone()
    random_rows = [i for i, o in enumerate(options) if not o.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [options[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            seed = options[i].seed
            g = step_generator(seed, positions[i], logits.device) if seed is not None else None
            noise = torch.empty_like(probs[j]).exponential_(generator=g)
            tokens[i] = (probs[j] / noise).argmax()  # Gumbel-max in exponential form: a draw from probs
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, options, token_list)


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
    max_k = max(options[i].logprobs or 0 for i in wanted)
    top_v, top_i = logp.topk(max_k, dim=-1) if max_k else (None, None)
    for j, i in enumerate(wanted):
        k = options[i].logprobs or 0
        top = []
        if k and top_v is not None and top_i is not None:
            top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))
        out[i] = TokenLogprobs(float(logp[j, tokens[i]]), top)
    return out
