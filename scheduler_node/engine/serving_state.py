"""Whether this replica takes new requests, and why not. The engine core owns it and hands it to the two
collaborators that change it; each field has one writer: the loop (`failed`), the intake (`draining`), the
failures (`gave_up`, `unusable_loras`). The doors read it through EngineCore (`unavailable`, health)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ServingState:
    failed: str = ""  # the engine loop raised: it stopped for good
    draining: bool = False  # no new requests (Drain, SIGTERM); never cleared
    gave_up: str = ""  # a rank was lost and none rejoined in time; cleared once every rank is back
    # LoRA adapters (ids) a worker could not use (StepError.adapters), with why: a request naming one ends at once.
    # Loading the adapter again gives it a new id. Written by the failures, read by the intake.
    unusable_loras: dict[int, str] = field(default_factory=dict)

    def refusal(self) -> str:
        """Why a new request cannot be admitted now ("" when it can)."""
        if self.draining:
            return "the server is draining: it finishes what runs and takes nothing new"
        return self.failed or self.gave_up
