"""The engine loop's settings (what `vllm-scheduler` and `LLM` set), and the step deadline's growth."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineOptions:
    rejoin_timeout: float = 60.0  # seconds a lost rank may take to come back before its requests fail
    max_waiting_requests: int = 0  # waiting sequences at most (0: unbounded)
    scheduler_delay: float = 0.0  # seconds to wait for more arrivals before a small batch
    step_timeout: float = 60.0  # seconds a step may run (plus STEP_SECONDS_PER_TOKEN each) before its ranks are lost
    # Keep the garbage collector's pauses out of the steps (engine/collector.py); a server process sets it.
    schedule_gc: bool = False
    # With schedule_gc: seconds the engine stays idle before the idle full collection runs. At once, its tens of
    # milliseconds would be the wait of a client's next request whenever it sends one after another.
    idle_collection_delay_s: float = 1.0
    # Detokenize and stream on a thread of the output side's own (engine/output_thread.py), off the loop's.
    output_thread: bool = True

    def __post_init__(self) -> None:
        if not self.rejoin_timeout > 0 or not self.step_timeout > 0:
            raise ValueError("rejoin_timeout and step_timeout must be > 0")
        if self.idle_collection_delay_s < 0:
            raise ValueError("idle_collection_delay_s must be >= 0")
        if self.max_waiting_requests < 0 or self.scheduler_delay < 0:
            raise ValueError("max_waiting_requests and scheduler_delay must be >= 0")


# A step's deadline grows with its work: a long prefill on a slow CPU may take this much per token.
STEP_SECONDS_PER_TOKEN = 0.02
