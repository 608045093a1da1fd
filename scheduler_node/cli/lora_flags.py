"""The LoRA flags (vllm-scheduler, vllm-serve), as vLLM spells them."""

from __future__ import annotations

import argparse

from scheduler_node.core.config import SchedulerConfig
from scheduler_node.engine.lora_registry import DEFAULT_MAX_LORA_RANK, LoraConfig, parse_lora_module

_SCHEDULER = SchedulerConfig()


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters (PEFT folders) over the base model: a request names one as its model",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters registered at start, each name=path of a PEFT folder (adapter_config.json and "
        "adapter_model.safetensors); more are loaded at run time with POST /v1/load_lora_adapter",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=_SCHEDULER.max_loras,
        help="adapters resident on the workers at once; a request whose adapter finds every slot in use waits "
        "while others run, and the least recently used idle adapter is evicted",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=_SCHEDULER.max_cpu_loras,
        help="adapters evicted from the workers' slots that they keep in host memory (least recently evicted out "
        "first), so a reload skips the disk; 0: none",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help="the largest adapter rank (r) accepted",
    )


def lora_config(args: argparse.Namespace) -> LoraConfig:
    """The LoRA settings of the command line (ValueError naming the flag)."""
    modules = tuple(parse_lora_module(text) for text in args.lora_modules)
    return LoraConfig(args.enable_lora, modules, args.max_lora_rank)
