from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from minivllm.tiny_models import TINY_VARIANTS, build_tiny_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from worker_node.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("mistral", tmp_path_factory.mktemp("tiny-mistral"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    """The tiny model of a TINY_VARIANTS name, built on first use and shared by the whole session."""
    built: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in built:
            kind, overrides = TINY_VARIANTS[name]
            built[name] = build_tiny_model(kind, tmp_path_factory.mktemp(name), smollm2_dir, **overrides)
        return built[name]

    return folder
