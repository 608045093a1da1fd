"""Overlapped steps: on a GPU the next plan is launched before the host has read this step's tokens (issue 24).

A step's host work (its plan's diffs, the inputs, the kernel launches, the reply) used to wait for the device at
the end of every step, where the sampled tokens were read back: the GPU then sat idle for the host part of the next
step. With steps overlapped, the step thread launches plan N+1 as soon as it arrives (under async scheduling it is
already there), its decodes reading step N's tokens where step N's sampler left them (InputBatch.reserve's
placeholders, gathered on the device), and only then waits for step N's tokens, whose copy to pinned host memory
ran behind step N on the device, to send step N's result. The host is one step ahead of the device, as in vLLM's
async scheduling with device-side token feedback and SGLang's overlap scheduler.

A step overlaps only when its tokens need nothing of the host: every sampler's row is `runs_on_device` (no
processor, no logprobs), it verifies no proposals, asks no draft model, and its tokens do not travel in plans
(P > 1 stages). Any other step, and the plan after a step the next plan cannot follow (`may_follow`), is finished
first, as before. On by default on CUDA devices only: a CPU computes a step while it is launched, so holding its
result back would only delay it (`--overlap-steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from proto.wire import StepPlan, StepResult
from settings.worker import OVERLAP_CHOICES


def overlaps_on(choice: str, device: torch.device) -> bool:
    """`--overlap-steps`: auto is on for CUDA devices."""
    if choice not in OVERLAP_CHOICES:
        raise ValueError(f"overlap_steps: must be one of {OVERLAP_CHOICES}, got {choice!r}")
    return choice == "on" or (choice == "auto" and device.type == "cuda")


class HasHandle(Protocol):
    @property
    def handle(self) -> int: ...


class DeviceTokens:
    """A step's sampled tokens where they were sampled, and their copy to the host under way: on a GPU into
    pinned memory behind the step's own work (an event marks its end), so reading them waits for this step only,
    not for the steps launched after it. On the rank that sampled, `faulted` (which rows' logits were not finite)
    travels in the same copy, and `faulted_handles` names those rows' requests."""

    def __init__(
        self,
        tokens: torch.Tensor,
        faulted: torch.Tensor | None = None,
        rows: Sequence[HasHandle] = (),
    ) -> None:
        self.tokens = tokens
        self._rows = rows
        both = tokens if faulted is None else torch.cat((tokens, faulted.to(tokens.dtype)))
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = both
        self._count = tokens.shape[0]

    def values(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host[: self._count].tolist()

    def faulted_handles(self) -> list[int]:
        """The handles of the rows whose logits were not finite (after `values`; none on a rank that did not
        sample)."""
        if self._host.shape[0] == self._count:
            return []
        flags = self._host[self._count :].tolist()
        return [self._rows[i].handle for i, bad in enumerate(flags) if bad]


@dataclass(slots=True)
class Launched:
    """A plan whose work is launched; `finish` waits for what the host still needs of it and makes its reply.
    `overlaps`: its tokens are still on the device, and the next plan may be launched before `finish`."""

    step_id: int
    finish: Callable[[], StepResult]
    overlaps: bool = False


def may_follow(plan: StepPlan) -> bool:
    """Whether `plan` may be launched before the step before it is finished: not when it brings tokens or
    proposals the host makes from that step's tokens, or asks the draft model (which reads them on the host)."""
    if plan.propose:
        return False
    return not any(c.draft_token_ids or c.new_token_ids for c in plan.cached_requests)
