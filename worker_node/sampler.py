"""Sampling: the logits processors of every request of a step, vectorised over the batch with per-request
parameters mixed freely, then greedy or seeded sampling that survives batching and preemption.

Order (HF's, see worker_node/logits_processors.py): logit bias, repetition penalty, frequency and presence
penalties, bad words, min_tokens, the grammar's mask; greedy rows take the argmax of that; sampled rows go on
through temperature, top-k, top-p, min-p. Returned logprobs are the model's own (before any processing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from kernels.cpu_argmax import checked_argmax_rows
from proto.wire import SamplingOptions, TokenLogprobs
from worker_node import logits_processors as lp
from worker_node.runtime.host_copy import to_device
from worker_node.structured import GrammarMasks, GrammarRow
from worker_node.token_counts import TokenCounts

_MASK64 = (1 << 64) - 1


class SamplingRequest(Protocol):
    """What the sampler reads of a request the worker holds."""

    handle: int  # the request's id on the wire
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling: SamplingOptions


def seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (seed, position): splitmix64 of the two, 53 bits kept."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


@dataclass(frozen=True, slots=True)
class RowFlags:
    """What the sampler needs to know of each row before it looks at a request: whether it is plain (greedy, no
    processor: the argmax of the model's logits is its token) and whether it wants logprobs. The worker keeps them
    per request (worker_node/input_batch.py); `of` works them out."""

    plain: np.ndarray  # bool [B]
    logprobs: np.ndarray  # bool [B]

    @classmethod
    def of(cls, requests: Sequence[SamplingRequest]) -> RowFlags:
        plain = np.fromiter((is_plain(r.sampling) for r in requests), dtype=bool, count=len(requests))
        wants = np.fromiter((r.sampling.logprobs is not None for r in requests), dtype=bool, count=len(requests))
        return cls(plain, wants)


@dataclass(frozen=True, slots=True)
class Drawn:
    """A step's sampled tokens and which rows' logits were not finite, both where the logits are."""

    tokens: torch.Tensor  # int64 [B]
    # bool [B]: the row's logits are not finite (NaN or infinite): its request must fail. None: no row is (known
    # at once on the CPU; on a GPU the flags stay on the device and travel with the tokens).
    faulted: torch.Tensor | None


class Sampler:
    """Samples the next token of each request; keeps what spans steps (token counts, grammar matchers)."""

    def __init__(self, vocab_size: int, device: torch.device, tokenizer_file: Path | None = None) -> None:
        self.counts = TokenCounts(vocab_size, device)
        self.grammars = GrammarMasks(tokenizer_file, vocab_size) if tokenizer_file is not None else None

    def forget(self, handle: int) -> None:
        self.counts.release(handle)
        if self.grammars is not None:
            self.grammars.forget(handle)

    def start(self, requests: Sequence[SamplingRequest], flags: RowFlags | None = None) -> None:
        """Begin the grammar masks of the requests this step samples, while the forward pass runs."""
        special = requests if flags is None else [requests[i] for i in np.flatnonzero(~flags.plain).tolist()]
        rows = [_grammar_row(r) for r in special if r.sampling.structured is not None]
        if rows and self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer.json on the worker")
        if self.grammars is not None:
            self.grammars.start(rows)

    def cancel(self) -> None:
        """The step stops before sampling (interrupted): let its masks finish, unused."""
        if self.grammars is not None:
            self.grammars.wait()

    def sample(
        self, logits: torch.Tensor, requests: Sequence[SamplingRequest], flags: RowFlags | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of `logits` ([B, V] float32, row i for requests[i], whose `flags` these are when
        given), with the logprobs the rows want; `start` was called with them. `logits` is only read: plain rows
        take its argmax where it lies, the other rows are copied out (only they: the vocabulary is never copied
        for a row that needs no processor). `draw` says which rows' logits were not finite as well."""
        flags = flags or RowFlags.of(requests)
        token_list = self.draw(logits, requests, flags).tokens.tolist()
        return token_list, self.logprobs(logits, token_list, requests, flags)

    def logprobs(
        self, logits: torch.Tensor, tokens: list[int], requests: Sequence[SamplingRequest], flags: RowFlags
    ) -> list[TokenLogprobs | None]:
        """The model's logprob of each row's token and its top alternatives, for the rows that want them."""
        wanted = np.flatnonzero(flags.logprobs).tolist()
        out: list[TokenLogprobs | None] = [None] * len(requests)
        if wanted:
            ks = [requests[i].sampling.logprobs or 0 for i in wanted]
            lps = token_logprobs(logits[wanted], [tokens[i] for i in wanted], ks)
            for i, value in zip(wanted, lps):
                out[i] = value
        return out

    def draw(self, logits: torch.Tensor, requests: Sequence[SamplingRequest], flags: RowFlags) -> Drawn:
        """`sample`'s tokens, where the logits are (int64 [B]), and the rows whose logits are not finite. Nothing
        here waits for the device unless a processor must (a grammar row that every other processor left without
        a token): a step whose rows need no processor leaves its tokens on a GPU for the next step to read there
        (worker_node/step_overlap.py).

        A row is faulted when its maximum is not finite: a NaN anywhere (argmax answers a row's first NaN), an
        infinity, or nothing but -inf. Its token is meaningless and its request must fail alone; the check reads one
        logit a row, the one argmax found, so it costs nothing beside the argmax itself."""
        special = np.flatnonzero(~flags.plain).tolist()
        best, faulted = checked_argmax(logits)  # of the model's own logits: the plain rows' tokens
        if len(special) == len(requests):
            return Drawn(self._sample_special(logits, requests, None), faulted)
        if special:
            index = to_device(special, logits.device, torch.int64)
            best[index] = self._sample_special(logits, requests, index, special)
        return Drawn(best, faulted)

    def _sample_special(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRequest],
        index: torch.Tensor | None,
        picked: list[int] | None = None,
    ) -> torch.Tensor:
        """The tokens of the rows `index` of `logits` (every row when None; `picked`: the same, on the host):
        processed, then the argmax for greedy rows and a draw for the others."""
        chosen = requests if picked is None else [requests[i] for i in picked]
        if index is not None:
            part = logits[index]  # a copy of these rows: the processors write it
        elif any(_processes(r.sampling) for r in chosen):
            part = logits.clone()
        else:
            part = logits  # sampled rows without processors: the temperature makes the warps' own tensor
        processed = self._process_rows(part, logits, index, chosen)
        options = [r.sampling for r in chosen]
        tokens = argmax(processed)
        random_rows = [i for i, o in enumerate(options) if not o.greedy]
        if random_rows:
            rows = to_device(random_rows, logits.device, torch.int64)
            warped = processed if len(random_rows) == len(options) else processed[rows]
            probs = _warp(warped, [options[i] for i in random_rows]).softmax(dim=-1)
            outputs = [len(chosen[i].token_ids) - chosen[i].num_prompt_tokens for i in random_rows]
            tokens[rows] = _draw(probs, [options[i].seed for i in random_rows], outputs)
        return tokens

    def _process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """The processors every row goes through, greedy or not (a new tensor: `logits` stays the model's)."""
        return self._process_rows(logits.clone(), logits, None, requests)

    def _process_rows(
        self, out: torch.Tensor, raw: torch.Tensor, index: torch.Tensor | None, requests: Sequence[SamplingRequest]
    ) -> torch.Tensor:
        """The processors of `requests`, on `out` (a copy of rows `index` of the model's logits `raw`, or of all of
        them when None; row i is requests[i]'s), in place where they can be."""
        options = [r.sampling for r in requests]
        bias = [(i, t, b) for i, o in enumerate(options) for t, b in o.logit_bias.items()]
        lp.add_bias(out, [i for i, _, _ in bias], [t for _, t, _ in bias], [b for _, _, b in bias])
        out = self._penalties(out, requests)
        banned = _banned(requests)
        lp.ban(out, [i for i, _ in banned], [t for _, t in banned])
        if self.grammars is not None and any(o.structured is not None for o in options):
            constrained = [i for i, o in enumerate(options) if o.structured is not None]
            allowed = self.grammars.allowed(out.device)
            rows = to_device(constrained, out.device, torch.int64)
            out[rows] = out[rows].masked_fill(~allowed, lp.NEG_INF)
            _revive(out, raw, index, rows, allowed)
        return out

    def _penalties(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        penalised = [i for i, r in enumerate(requests) if _penalises(r.sampling)]
        if not penalised:
            return logits
        chosen = [requests[i] for i in penalised]
        slots = self.counts.rows([(r.handle, r.token_ids, r.num_prompt_tokens) for r in chosen])
        counts = self.counts.output[slots]
        rows = to_device(penalised, logits.device, torch.int64)
        part = logits[rows]
        options = [r.sampling for r in chosen]
        if any(o.repetition_penalty != 1.0 for o in options):
            seen = self.counts.prompt[slots] | (counts > 0)
            part = lp.repetition_penalty(part, seen, _column([o.repetition_penalty for o in options], part))
        if any(o.frequency_penalty or o.presence_penalty for o in options):
            frequency = _column([o.frequency_penalty for o in options], part)
            part = lp.frequency_presence_penalty(
                part, counts, frequency, _column([o.presence_penalty for o in options], part)
            )
        logits[rows] = part
        return logits


def checked_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`argmax`, and which rows' maximum is not finite (bool [B]; None when the CPU kernel saw none, in the same
    pass: a clean step pays nothing for the check)."""
    if logits.device.type == "cpu":
        native = checked_argmax_rows(logits)
        if native is not None:
            best, not_finite = native
            return best, (None if not not_finite else _not_finite(logits, best))
    best = argmax(logits)
    return best, _not_finite(logits, best)


def _not_finite(logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(logits.gather(1, best.unsqueeze(1)).squeeze(1))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first one on ties and the first NaN of a row with one (as torch's and HF's). On the
    CPU, kernels/csrc/argmax_cpu.c's: it reads float32 or bfloat16 logits once, in place (torch's argmax over rows
    is not vectorised: 31 ms for 256 x 49,152 where this takes a few). Without a C compiler, numpy's for float32
    (the same single pass, float32 only)."""
    if logits.device.type == "cpu":
        native = checked_argmax_rows(logits)
        if native is not None:
            return native[0]
        if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
            return torch.from_numpy(logits.detach().numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


def is_plain(o: SamplingOptions) -> bool:
    """A greedy row that no processor changes: its token is the argmax of the model's own logits."""
    return o.temperature == 0.0 and not _processes(o)


def runs_on_device(o: SamplingOptions) -> bool:
    """A row whose token the device can draw alone, with nothing read back on the host: no processor (they read
    the request's tokens there) and no logprobs. Greedy, temperature, top-k/p, min-p and seeds qualify."""
    return o.logprobs is None and not _processes(o)


def _processes(o: SamplingOptions) -> bool:
    """Whether a processor may change this row's logits (every request's, greedy or not: bias, penalties, bans,
    a grammar); the warps (temperature, top-k/p, min-p) are the sampled rows' own."""
    return bool(
        o.logit_bias or o.bad_words or o.structured is not None or (o.min_tokens and o.stop_token_ids) or _penalises(o)
    )


def _penalises(o: SamplingOptions) -> bool:
    return o.repetition_penalty != 1.0 or o.frequency_penalty != 0.0 or o.presence_penalty != 0.0


def _banned(requests: Sequence[SamplingRequest]) -> list[tuple[int, int]]:
    """(row, token) pairs banned this step: a bad word's last token where the tokens before it end the sequence
    (HF NoBadWords, over prompt and output), and the end tokens before min_tokens (HF MinNewTokensLength)."""
    banned = []
    for i, r in enumerate(requests):
        o = r.sampling
        for word in o.bad_words:
            prefix = len(word) - 1
            if prefix <= len(r.token_ids) and (prefix == 0 or r.token_ids[-prefix:] == word[:-1]):
                banned.append((i, word[-1]))
        if len(r.token_ids) - r.num_prompt_tokens < o.min_tokens:
            banned += [(i, t) for t in o.stop_token_ids]
    return banned


def _revive(
    out: torch.Tensor, raw: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor, allowed: torch.Tensor
) -> None:
    """A constrained row that every processor together left without a token (a bad word or min_tokens ban on
    the only tokens its grammar allows) samples from its grammar alone: the grammar is never broken. A matcher in
    error (it allows nothing) leaves its row unconstrained rather than sampling from nothing. Row i of `out` is
    row index[i] of the model's logits `raw` (row i when `index` is None)."""
    dead = torch.isneginf(out[rows]).all(dim=-1)
    if bool(dead.any()):
        revived = rows[dead]
        out[revived] = raw[revived if index is None else index[revived]].masked_fill(~allowed[dead], lp.NEG_INF)
        lost = rows[dead & ~allowed.any(dim=-1)]
        out[lost] = raw[lost if index is None else index[lost]]


def _warp(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, each on the rows that use it."""
    logits = lp.temperature(logits, [o.temperature for o in options])
    for active, warp, value in (
        (lambda o: o.top_k > 0, lp.top_k, lambda o: o.top_k),
        (lambda o: o.top_p < 1.0, lp.top_p, lambda o: o.top_p),
        (lambda o: o.min_p > 0.0, lp.min_p, lambda o: o.min_p),
    ):
        rows = [i for i, o in enumerate(options) if active(o)]
        if rows:
            index = to_device(rows, logits.device, torch.int64)
            logits[index] = warp(logits[index], [value(options[i]) for i in rows])
    return logits


def _draw(probs: torch.Tensor, seeds: list[int | None], positions: list[int]) -> torch.Tensor:
    """A token from each row of `probs`, for the whole batch at once: each row draws one uniform number and
    inverts its distribution's CDF. A seeded row's number is a hash of (seed, output position), so the same
    request draws the same token at the same position in any batch, on any worker, after any preemption."""
    drawn = torch.rand(len(seeds), dtype=torch.float64).tolist()  # unseeded rows: torch's generator
    uniforms = [u if seed is None else seeded_uniform(seed, pos) for u, seed, pos in zip(drawn, seeds, positions)]
    cdf = probs.double().cumsum(dim=-1)  # float64: the last of 50k+ summands still moves the sum
    targets = (to_device(uniforms, probs.device, torch.float64) * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Each row's logprob of its token, and its ks[row] most likely tokens (best first)."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    top_v, top_i = logp.topk(max(ks), dim=-1)
    values, ids = top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(chosen[j], list(zip(ids[j][:k], values[j][:k]))) for j, k in enumerate(ks)]


def _grammar_row(r: SamplingRequest) -> GrammarRow:
    assert r.sampling.structured is not None
    output = r.token_ids[r.num_prompt_tokens :]
    return GrammarRow(r.handle, r.sampling.structured, output, frozenset(r.sampling.stop_token_ids))


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.device, like.dtype).unsqueeze(1)
