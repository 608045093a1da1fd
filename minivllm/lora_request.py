"""LoRARequest, as vLLM spells it: which adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder served under `lora_name`. `lora_int_id` (> 0) is vLLM's identity of the adapter;
    here the name is, and one name always means one folder while it is loaded."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name: must not be empty")
