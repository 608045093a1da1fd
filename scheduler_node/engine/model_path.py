"""Where the model lives, from `--model`: an HF folder, a GGUF file, an HF hub id already in the local HF cache,
or the default SmolLM2. The answer is always a folder with config.json and the tokenizer, which the scheduler
reads and the workers load (safetensors shards, or a link to a GGUF file they dequantise).

Nothing is downloaded: a hub id that is not in the cache is an error naming the id and the cache. Pickle
checkpoints are refused here, before any worker is waited for. Work that needs transformers (converting the
default GGUF, reading a GGUF's config and tokenizer) runs in a child process: the scheduler never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

from proto.architectures import architecture_of
from proto.checkpoints import PICKLE_SUFFIXES, pickle_refusal, weight_files
from proto.model_cache import DEFAULT_MODEL_NAME, cache_dir, default_model_dir
from settings.server import DEFAULT_MODEL

logger = logging.getLogger(__name__)

DEFAULT = DEFAULT_MODEL
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, fullmatch (`$` would pass a final newline)


def resolve_model(model: str, hub_cache: Path | None = None) -> Path:
    """The model folder for `--model`, checked: a config of a supported architecture, loadable weights.
    `hub_cache`: the HF hub cache to look ids up in (default: huggingface_hub's, from HF_HUB_CACHE / HF_HOME)."""
    if model == DEFAULT:
        return _default_model()
    path = Path(model).expanduser()
    if path.is_file():
        folder = _file_model(path.resolve(), model)
    elif path.is_dir():
        folder = path.resolve()
    elif _HUB_ID.fullmatch(model):
        folder = _hub_snapshot(model, hub_cache)
    else:
        raise FileNotFoundError(f"--model {model}: no such file or folder, and not an HF hub id (org/name)")
    return _checked(folder, model)


def served_name(model: str) -> str:
    """The name `--model` is served under unless --served-model-name says otherwise: a hub id as given, else the
    folder's name (a GGUF file's stem)."""
    if model == DEFAULT:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists() and _HUB_ID.fullmatch(model):
        return model
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def _checked(folder: Path, model: str) -> Path:
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"--model {model}: {folder} is not an HF model folder (no config.json)")
    try:
        architecture_of(json.loads(config.read_text()))
    except ValueError as exc:
        raise ValueError(f"--model {model}: {exc}") from None
    weight_files(folder)  # raises, naming the folder, when it holds no weights we load (or only pickles)
    return folder


def _file_model(path: Path, model: str) -> Path:
    if path.suffix in PICKLE_SUFFIXES:
        raise pickle_refusal(path)
    if path.suffix != ".gguf":
        raise ValueError(f"--model {model}: a file, but not a GGUF file (.gguf); pass a folder, a .gguf or a hub id")
    return _gguf_folder(path)


def _gguf_folder(gguf: Path) -> Path:
    """A folder with the GGUF's config and tokenizer beside a link to it, prepared once per file version."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if not (folder / "config.json").is_file():
        logger.info("reading the config and tokenizer of %s into %s", gguf, folder)
        argv = ["-m", "worker_node.convert", "--input", str(gguf), "--output", str(folder), "--link"]
        _run_helper(argv, f"cannot read the GGUF file {gguf}")
    return folder


def _hub_snapshot(repo_id: str, hub_cache: Path | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache or Path(constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"--model {repo_id}: not in the local HF cache ({cache}); minivllm does not download models: fetch it "
            f"first (hf download {repo_id}), point HF_HUB_CACHE at the cache that holds it, or pass a folder"
        ) from None


def _default_model() -> Path:
    """The default SmolLM2, converted from its GGUF by a worker-side helper the first time."""
    path = default_model_dir()
    if not (path / "config.json").is_file():
        logger.info("preparing the default model in %s", path)
        _run_helper(["-m", "worker_node.default_model"], "cannot prepare the default model")
    return path


def _run_helper(argv: list[str], failure: str) -> None:
    """A worker-side module in a child process; its log goes to our stderr."""
    if subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL).returncode:
        raise ValueError(f"{failure} (the helper's log is above)")
