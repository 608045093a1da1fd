"""Where the default model is cached: a contract between the scheduler (tokenizer) and the workers (weights)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("MINIVLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minivllm"
    )
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME
