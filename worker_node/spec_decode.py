"""Verifying proposed tokens (speculative decoding) in the target model's own step.

A request with proposals d_1..d_k computes its last known token and the k proposals in one forward pass, which
gives the model's distribution at k + 1 positions. The sampler draws a token at each of them exactly as a normal
step would there (the same processors, and for a seeded request the same uniform number: a hash of the seed and
the output position), as if every proposal before it had been accepted. The output is the longest prefix of
proposals that equals those draws, then the draw after it: t_0 .. t_m where m is the first i with t_{i} != d_{i+1}
(or k).

Why this is exact: with a proposal that is a single token (a point mass, as n-gram proposals are), the standard
speculative sampling rule (accept d with probability min(1, p(d) / q(d)) = p(d), else draw from the residual
max(0, p - q) normalised, which is p without d) is the same as "draw x from p, accept when x == d, else emit x":
P(accept) = p(d), and a rejected draw is p conditioned on x != d. Each emitted token is therefore distributed as
the target's; greedy rows take the argmax at each position, so greedy output is token-identical to decoding
without speculation, and so is a seeded request's (its draws do not depend on the batch or on speculation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.wire import SamplingOptions
from worker_node.sampler import RowFlags, SamplingRequest


@dataclass(slots=True)
class DraftPosition:
    """A request seen at one proposed position: its tokens as if the proposals before it were accepted (the
    sampler reads the output position of a seeded draw from them)."""

    handle: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingOptions


@dataclass(slots=True)
class DraftRows:
    """A step's sampling rows when some of its requests have proposals: each such request has 1 + k rows."""

    counts: np.ndarray  # rows of each sampler (1 + its proposals)
    firsts: np.ndarray  # index of each sampler's first row
    requests: list[SamplingRequest]  # one per row
    flags: RowFlags  # one per row
    drafts: list[list[int]]  # each sampler's proposals


def expand(
    samplers: list[SamplingRequest], flags: RowFlags, drafts: list[list[int]], sample_ends: np.ndarray
) -> tuple[np.ndarray, DraftRows]:
    """The hidden-state rows to score (each sampler's last token row, and the rows of its proposals before it)
    and the per-row requests and flags."""
    counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
    firsts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=firsts[1:])
    total = int(counts.sum())
    offsets = np.arange(total) - np.repeat(firsts, counts)
    rows = np.repeat(sample_ends - counts + 1, counts) + offsets
    requests: list[SamplingRequest] = []
    for state, plain, proposed in zip(samplers, flags.plain.tolist(), drafts):
        if not proposed or plain:  # a greedy row's argmax reads no token list
            requests += [state] * (len(proposed) + 1)
            continue
        tokens = list(state.token_ids)
        for i in range(len(proposed) + 1):
            requests.append(DraftPosition(state.handle, tokens[:], state.num_prompt_tokens, state.sampling))
            if i < len(proposed):
                tokens.append(proposed[i])
    row_flags = RowFlags(np.repeat(flags.plain, counts), np.repeat(flags.logprobs, counts))
    return rows, DraftRows(counts, firsts, requests, row_flags, drafts)


def accept(tokens: list[int], draft_rows: DraftRows) -> list[list[int]]:
    """Each sampler's output from the tokens drawn at its rows: the proposals its draws agree with, then the next
    draw."""
    out = []
    for first, proposed in zip(draft_rows.firsts.tolist(), draft_rows.drafts):
        drawn = tokens[first : first + len(proposed) + 1]
        m = 0
        while m < len(proposed) and drawn[m] == proposed[m]:
            m += 1
        out.append(drawn[: m + 1])
    return out
