"""The steps from logits to a sampling distribution, each vectorised over a batch with per-row parameters.

Each step computes exactly what HF transformers' processor or warper of the same name computes for one row (the
same operations in the same float32 arithmetic; tests/worker_node/test_logits_processors.py checks them against HF),
in HF's
order: logit bias (SequenceBias), repetition penalty, frequency and presence penalties (OpenAI's, no HF
counterpart), banned tokens (NoBadWords, MinNewTokensLength, the grammar's mask); then, for sampled rows only,
temperature, top-k, top-p, min-p. Masked tokens get -inf, as HF's filter value.
"""

from __future__ import annotations

import torch

from worker_node.runtime.host_copy import to_device

NEG_INF = float("-inf")


def add_bias(logits: torch.Tensor, rows: list[int], tokens: list[int], bias: list[float]) -> None:
    """logits[rows[i], tokens[i]] += bias[i], in place (HF SequenceBiasLogitsProcessor on one-token sequences)."""
    if rows:
        index = (_index(rows, logits), _index(tokens, logits))
        logits.index_put_(index, to_device(bias, logits.device, logits.dtype), accumulate=True)


def ban(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """logits[rows[i], tokens[i]] = -inf, in place (HF NoBadWords, MinNewTokensLength)."""
    if rows:
        logits[_index(rows, logits), _index(tokens, logits)] = NEG_INF


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Tokens `seen` (bool [B, V]: in the prompt or the output) have a positive logit divided by the row's
    penalty ([B, 1]) and a negative one multiplied by it (HF RepetitionPenaltyLogitsProcessor)."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def frequency_presence_penalty(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI's penalties: minus frequency x each token's count in the output, minus presence once for each
    token in it (counts [B, V], the penalties [B, 1])."""
    return logits - frequency * counts - presence * (counts > 0)


def temperature(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """HF TemperatureLogitsWarper, one temperature per row."""
    return logits / _column(temperatures, logits)


def top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """HF TopKLogitsWarper: keep the logits at least as large as the row's k-th largest (ties stay); k <= 0 or
    k >= vocab keeps everything."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    kth = logits.topk(max(ks), dim=-1).values.gather(1, _column([k - 1 for k in ks], logits, torch.int64))
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """HF TopPLogitsWarper: sorted ascending, drop the tokens whose cumulative probability is <= 1 - p (the
    most likely one always stays). The threshold is 1 - p taken in double, as HF's Python float is."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= _column([1 - p for p in ps], logits)
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(1, order, remove), NEG_INF)


def min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """HF MinPLogitsWarper: drop the tokens less likely than min_p x the most likely one's probability (which
    always stays)."""
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    remove = probs < _column(min_ps, logits) * top
    remove.scatter_(-1, probs.topk(1, dim=-1).indices, False)
    return logits.masked_fill(remove, NEG_INF)


def _column(values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(values, like.device, dtype or like.dtype).unsqueeze(1)


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.device, torch.int64)
