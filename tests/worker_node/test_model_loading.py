"""What `--model` accepts: an HF folder, an HF hub id from the local cache (never downloaded), a GGUF file (its
tensors dequantised by the workers at load), and what `vllm-convert` writes; pickle checkpoints refused unopened."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kernels.backend import select_attention_backend
from proto.checkpoints import PickleCheckpointError
from scheduler_node.engine.model_path import resolve_model
from tests.support.engine import load_runner
from worker_node.convert import main as vllm_convert
from worker_node.default_model import find_gguf
from worker_node.models import loader
from worker_node.models.gguf import LINK_NAME

pytestmark = pytest.mark.model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """The layout huggingface_hub keeps: models--org--name/refs/main naming a snapshot folder of the files."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(model, repo / "snapshots" / REVISION)
    return repo / "snapshots" / REVISION


def test_hub_id_resolves_from_the_local_cache(tmp_path: Path, tiny_llama_dir: Path) -> None:
    snapshot = fake_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama_dir)
    assert resolve_model("acme/tiny-llama", hub_cache=tmp_path / "hub") == snapshot


def test_hub_id_not_in_the_cache_names_the_id_and_the_cache(tmp_path: Path, tiny_llama_dir: Path) -> None:
    fake_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama_dir)
    with pytest.raises(FileNotFoundError) as error:
        resolve_model("acme/other-model", hub_cache=tmp_path / "hub")
    assert "acme/other-model" in str(error.value) and str(tmp_path / "hub") in str(error.value)


def test_missing_path_that_is_no_hub_id(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nowhere" / "deeper" / "model"))


class _Tripwire:
    """Unpickling this object creates `path`: proof that a loader unpickled the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.path,))


def test_pickle_checkpoints_are_refused_unopened(tmp_path: Path, tiny_llama_dir: Path) -> None:
    tripwire = tmp_path / "unpickled"
    folder = tmp_path / "pickled-model"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(tripwire)))
    with pytest.raises(PickleCheckpointError, match="never unpickles"):
        resolve_model(str(folder))  # the scheduler, before any worker is waited for
    with pytest.raises(PickleCheckpointError, match="pytorch_model.bin"):
        load_runner(folder, 4, 16)  # and a worker given the folder anyway
    with pytest.raises(PickleCheckpointError, match="model.pt"):
        shutil.copy(folder / "pytorch_model.bin", tmp_path / "model.pt")
        resolve_model(str(tmp_path / "model.pt"))
    assert not tripwire.exists()


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"):
        resolve_model(str(folder))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_gguf_file_is_served_directly(smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model X.gguf`: a folder of the GGUF's config and tokenizer beside a link to it, whose tensors the
    worker dequantises at load: the same weights as the default model converted from the same file."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))  # prepared afresh, by the scheduler's child process
    folder = resolve_model(str(find_gguf()))
    assert folder.is_relative_to(tmp_path)
    assert (folder / LINK_NAME).resolve() == find_gguf().resolve()
    assert not list(folder.glob("*.safetensors"))
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (folder / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    assert resolve_model(str(find_gguf())) == folder, "prepared once per GGUF file"
    direct = load_runner(folder, 4, 16).model.state_dict()
    converted = load_runner(smollm2_dir, 4, 16).model.state_dict()
    assert direct.keys() == converted.keys()
    for name, tensor in converted.items():
        assert torch.equal(direct[name], tensor), name


def test_vllm_convert_writes_a_safetensors_folder(tmp_path: Path, smollm2_dir: Path) -> None:
    out = tmp_path / "smollm2"
    assert vllm_convert(["--input", str(find_gguf()), "--output", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "tokenizer.json", "model.safetensors"}
    ours, reference = _tensors(out / "model.safetensors"), _tensors(smollm2_dir / "model.safetensors")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[name], reference[name]) for name in reference)
    assert resolve_model(str(out)) == out
    assert vllm_convert(["--input", str(find_gguf()), "--output", str(out)]) == 2, "an existing output is kept"
    assert vllm_convert(["--input", str(smollm2_dir / "config.json"), "--output", str(tmp_path / "x")]) == 2


def test_the_loader_collapses_a_cpu_model_unless_told_not(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    """A worker's --no-huge-pages (settings/fast_paths.py) reaches the loader, which then leaves the weights be."""
    collapsed: list[int] = []

    def collapse(tensors: Iterable[torch.Tensor]) -> int:
        collapsed.append(len(list(tensors)))
        return 0

    monkeypatch.setattr(loader, "collapse", collapse)
    backend = select_attention_backend("torch", torch.device("cpu"))
    for on in (True, False):
        loader.load_model(tiny_llama_dir, backend, torch.float32, torch.device("cpu"), 64, huge_pages=on)
    assert len(collapsed) == 1 and collapsed[0] > 0, collapsed
