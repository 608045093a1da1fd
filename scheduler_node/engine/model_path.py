"""Where the model lives: an HF folder, or the default SmolLM2 converted once by a worker-side helper."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from proto.model_cache import default_model_dir

logger = logging.getLogger(__name__)

DEFAULT = "default"


def resolve_model(model: str) -> Path:
    """Return the model folder; for `default`, convert the GGUF in a child process the first time."""
    if model != DEFAULT:
        path = Path(model).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: not an HF folder (no config.json)")
        return path
    path = default_model_dir()
    if not (path / "config.json").is_file():
        logger.info("preparing the default model in %s", path)
        subprocess.run([sys.executable, "-m", "worker_node.default_model"], check=True, stdout=subprocess.DEVNULL)
    return path
