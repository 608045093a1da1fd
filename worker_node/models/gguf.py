"""GGUF files (llama.cpp's format), read through transformers' GGUF support: the config and the tokenizer from
the file's metadata, the tensors dequantised to float32 under HF names (llama.cpp's q/k row permutation and
Gemma's norm offset undone by transformers' tensor processors).

A GGUF model folder is what `vllm-convert --link` writes and what the scheduler prepares for `--model X.gguf`:
config.json, generation_config.json and the tokenizer files beside a link to the GGUF file, whose tensors the
workers dequantise at load. Without `--link`, `vllm-convert` writes the dequantised tensors as safetensors.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

LINK_NAME = "model.gguf"


def read_tensors(gguf: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `gguf`, dequantised, under HF names; `folder`'s config.json names the architecture.

    transformers' `load_gguf_checkpoint` does the same but parses the metadata again and rebuilds gguf's name
    map once per submodule (half of its time on a 135M model); this reads the tensors once, maps their names
    with one name map, and lets transformers' tensor processors undo llama.cpp's rewrites."""
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, GGUFReader, dequantize, get_tensor_name_map
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = AutoConfig.from_pretrained(folder)
    reader = GGUFReader(str(gguf))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    arch_id = next((k for k, name in MODEL_ARCH_NAMES.items() if name == arch), None)
    if arch_id is None:
        raise ValueError(f"{gguf}: GGUF architecture {arch!r} is unknown to the gguf package")
    name_map = get_tensor_name_map(arch_id, config.num_hidden_layers)
    hf_names = {}
    for hf_name in _meta_model(config).state_dict():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            hf_names[f"{gguf_name}.{suffix}"] = hf_name
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    logger.info("dequantising %s", gguf)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        done = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=hf_names, parsed_parameters={})
        if done.name in hf_names:
            tensors[hf_names[done.name]] = torch.from_numpy(np.copy(done.weights))
    return tensors


def convert(gguf: Path, output: Path, link: bool = False) -> Path:
    """Write `output`: config, tokenizer and either the dequantised tensors (model.safetensors) or, with `link`,
    a link to the GGUF file. Written beside `output` and renamed into place, so a reader never sees half."""
    gguf = gguf.resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=output.parent))
    try:
        _write_metadata(gguf, scratch)
        if link:
            (scratch / LINK_NAME).symlink_to(gguf)
        else:
            _write_safetensors(read_tensors(gguf, scratch), scratch)
        try:
            scratch.rename(output)
        except OSError:  # another process won the race (or the folder is not empty)
            if not (output / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return output


def _write_metadata(gguf: Path, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    logger.info("reading the config and tokenizer of %s", gguf)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = [type(_meta_model(config)).__name__]
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _write_safetensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in tensors.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
