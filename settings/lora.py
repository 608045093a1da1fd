"""LoRA's settings besides the slots (`max_loras`, `max_cpu_loras`: settings/scheduler.py), as vLLM spells them."""

from __future__ import annotations

from dataclasses import dataclass

from settings.setting import check, setting

DEFAULT_MAX_LORA_RANK = 16


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules spelling) as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters: whether they are served, those registered at start, their largest rank."""

    enable_lora: bool = setting(
        False,
        readers="scheduler",
        help="serve LoRA adapters (PEFT folders) over the base model: a request names one as its model",
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        repeat="+",
        metavar="NAME=PATH",
        readers="scheduler",
        help="adapters registered at start, each name=path of a PEFT folder (adapter_config.json and "
        "adapter_model.safetensors); more are loaded at run time with POST /v1/load_lora_adapter",
    )
    max_lora_rank: int = setting(
        DEFAULT_MAX_LORA_RANK, low=1, readers=("scheduler", "worker"), help="the largest adapter rank (r) accepted"
    )

    def __post_init__(self) -> None:
        check(self)
        for text in self.lora_modules:
            parse_lora_module(text)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")

    @property
    def modules(self) -> list[tuple[str, str]]:
        """(name, path) of each adapter registered at start."""
        return [parse_lora_module(text) for text in self.lora_modules]
