from __future__ import annotations

import subprocess
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


# What a test touches decides its marker, so `pytest -m unit` (seconds) or `-m "not e2e"` select by cost without a
# hand-kept list: a module that starts processes is `e2e`; one that runs a model in this process is `model`; every
# other test is `unit`. A marker written on a test or module wins. `slow` stays explicit.
_PROCESS_SIGNS = ("subprocess", "Cluster(", "ServeProcess", "multiprocessing", "Popen")
_MODEL_SIGNS = ("_dir", "load_runner", "EngineRun", "build_tiny_model", "LLM(")
_KINDS = ("unit", "model", "e2e")


def _module_kind(path: Path, cache: dict[Path, str] = {}) -> str:  # noqa: B006 - a per-session memo
    if path not in cache:
        text = path.read_text()
        cache[path] = ("e2e" if any(s in text for s in _PROCESS_SIGNS)
                       else "model" if any(s in text for s in _MODEL_SIGNS) else "unit")  # fmt: skip
    return cache[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in _KINDS):
            item.add_marker(_module_kind(Path(str(item.fspath))))


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key (PEM)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
