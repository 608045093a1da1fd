"""Whether our paged attention can run a model, and why not: the design article's
`PagedAttention.supports(model_config)`, asked before a deployment rather than learnt from a worker that stops.

A model config is a config.json's dict (optionally with the article's `attention` section naming a backend), an
HF `PretrainedConfig`, our `ModelConfig`, or a model folder. The answer is a `Support`: truthy when it runs, and
printable either way, with every reason it does not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.attention_abi import AbiError, load_library
from kernels.backend import triton_available
from kernels.custom_kernels import library_of
from proto.attention_setting import AttentionChoice, from_mapping
from settings.plugins import load_named
from worker_node.models.config import ModelConfig
from worker_node.models.registry import MODELS


@dataclass(frozen=True, slots=True)
class Support:
    """`ok`, and in `reason` what was checked (when it runs) or every reason it does not."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return f"{'supported' if self.ok else 'not supported'}: {self.reason}"


def attention_support(model_config: object) -> Support:
    """Whether the workers' paged attention runs `model_config`'s model with the backend its `attention` section
    names (`auto` without one). TypeError for something that is not a model config at all."""
    raw, config = _read(model_config)
    problems = [config] if isinstance(config, str) else _model_problems(config)
    choice = _attention_choice(raw, problems)
    if choice is not None:
        problems += _backend_problems(choice, config if isinstance(config, ModelConfig) else None)
    if problems or isinstance(config, str):
        return Support(False, "; ".join(problems))
    return Support(True, _summary(config, choice))


def _model_problems(config: ModelConfig) -> list[str]:
    problems = []
    if config.architecture not in MODELS:
        problems.append(f"architecture {config.architecture!r} has no model class; supported: {', '.join(MODELS)}")
    if config.num_kv_heads <= 0 or config.num_heads % config.num_kv_heads:
        problems.append(
            f"num_attention_heads {config.num_heads} is not a multiple of num_key_value_heads {config.num_kv_heads}"
        )
    return problems


def _read(model_config: object) -> tuple[Mapping[str, Any], ModelConfig | str]:
    """The config's dict (empty for a ModelConfig) and the parsed config, or why it cannot be parsed."""
    if isinstance(model_config, ModelConfig):
        return {}, model_config
    if isinstance(model_config, (str, Path)):
        path = Path(model_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            model_config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return {}, f"cannot read {path}: {exc}"
    to_dict = getattr(model_config, "to_dict", None)
    if not isinstance(model_config, Mapping) and callable(to_dict):
        model_config = to_dict()  # an HF PretrainedConfig
    if not isinstance(model_config, Mapping):
        raise TypeError(
            "expected a model config: a config.json dict, an HF PretrainedConfig, a ModelConfig or a model folder, "
            f"got {type(model_config).__name__}"
        )
    try:
        return model_config, ModelConfig.from_dict(dict(model_config))
    except KeyError as exc:
        return model_config, f"the config has no {exc.args[0]!r}"
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        return model_config, str(exc)


def _attention_choice(raw: Mapping[str, Any], problems: list[str]) -> AttentionChoice | None:
    try:
        return from_mapping(raw["attention"]) if "attention" in raw else AttentionChoice("auto")
    except ValueError as exc:
        problems.append(str(exc))
        return None


def _backend_problems(choice: AttentionChoice, config: ModelConfig | None) -> list[str]:
    """What keeps the chosen backend from running this model (`config`: None when it could not be read)."""
    if choice.compiled:
        try:  # a library named with the kernel is checked, not registered: asking changes nothing
            library = (
                load_library(Path(choice.library).resolve()) if choice.library else library_of(choice, "attention.type")
            )
        except AbiError as exc:
            return [f"attention.library: {exc}"]
        except ValueError as exc:
            return [str(exc)]
        if choice.params and library.configure is None:
            return [f"attention.params: {library.path} exports no minivllm_attention_configure, so it takes none"]
        return []
    if ":" in choice.type:
        try:
            load_named(choice.type, "attention backend")
        except ValueError as exc:
            return [f"attention.type: {exc}"]
        return []
    triton = choice.type == "triton" or (choice.type == "auto" and torch.cuda.is_available() and triton_available())
    d = config.head_dim if config is not None else 16
    if triton and (d < 16 or d & (d - 1)):
        return [f"head_dim {d}: the triton backend needs a power of two, at least 16 (choose attention.type torch)"]
    return []


def _summary(config: ModelConfig, choice: AttentionChoice | None) -> str:
    parts = [
        f"{config.architecture}, {config.num_heads} query heads over {config.num_kv_heads} KV heads, "
        f"head_dim {config.head_dim}"
    ]
    windowed = [w for w in config.layer_windows if w]
    if windowed:
        parts.append(f"a sliding window of {max(windowed)} on {len(windowed)} of {config.num_layers} layers")
    if config.attn_logit_softcap:
        parts.append(f"scores soft-capped at {config.attn_logit_softcap:g}")
    kind = choice.type if choice is not None else "auto"
    if choice is not None and choice.compiled:
        kind += " (a compiled kernel: float32 KV caches, run the model with dtype float32)"
    parts.append(f"attention backend {kind}")
    return "; ".join(parts)
