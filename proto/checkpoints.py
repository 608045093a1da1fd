"""Which weight files a model folder holds, checked the same way by the scheduler (before it waits for workers)
and by the workers (before they read): safetensors shards, or one GGUF file. Pickle-based checkpoints
(`pytorch_model.bin`, `.pt`, ...) are refused, never opened: unpickling runs arbitrary code. Pure Python.
"""

from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SAFETENSORS = "safetensors"
GGUF = "gguf"


class PickleCheckpointError(ValueError):
    """The weights are in a pickle format, which minivllm refuses to load."""


def pickle_refusal(path: Path) -> PickleCheckpointError:
    return PickleCheckpointError(
        f"{path} is a pickle checkpoint ({path.suffix}); minivllm never unpickles weights (unpickling runs "
        "arbitrary code). Save the model as safetensors (transformers: save_pretrained(..., "
        "safe_serialization=True)) or GGUF and pass that instead"
    )


def weight_files(folder: Path) -> tuple[str, list[Path]]:
    """(SAFETENSORS, shards) or (GGUF, [file]) for a model folder; a precise error when it holds neither."""
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return SAFETENSORS, shards
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUF, ggufs
    if ggufs:
        raise ValueError(f"{folder} holds several GGUF files ({', '.join(p.name for p in ggufs)}); pass one file")
    pickled = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise pickle_refusal(pickled[0])
    raise FileNotFoundError(f"{folder} holds no weights: no *.safetensors and no *.gguf file")
