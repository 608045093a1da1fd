from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from minivllm.tiny_models import TINY_VARIANTS, build_tiny_llava, build_tiny_model


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
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random LLaVA (CLIP tower, projector, Llama decoder) with its image processor and an `<image>` token."""
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), smollm2_dir)


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


# Each test module declares its cost with `pytestmark` (unit: no model and no process; model: runs a model in this
# process; e2e: starts processes), so `pytest -m unit` (seconds) or `-m "not e2e"` select by cost. A test that
# declares none, or more than one, stops the run: a kind guessed from a file's text was wrong as often as right.
_KINDS = ("unit", "model", "e2e")


# The modules run slowest kind first: those with a `slow` test, then e2e, model and unit ones, each kind in
# collection order. scripts/test.sh's two processes take whole modules in this order (--dist loadfile
# --no-loadscope-reorder), the next one when at most two tests of their own are left: a slow module taken last keeps
# one process busy for a minute or two while the other has nothing left (xdist's own order, by test count, ended
# with the one-test modules: the Ray launcher's and the soak's, about 100 s each).
_RUN_ORDER = ("slow", "e2e", "model", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    undeclared = [item.nodeid for item in items if sum(1 for k in _KINDS if item.get_closest_marker(k)) != 1]
    if undeclared:
        raise pytest.UsageError(f"declare exactly one of {_KINDS} (pytestmark) on: {undeclared[:10]}")
    rank: dict[Path, int] = {}
    for item in items:
        cost = min(i for i, mark in enumerate(_RUN_ORDER) if item.get_closest_marker(mark))
        rank[item.path] = min(cost, rank.get(item.path, cost))
    items.sort(key=lambda item: rank[item.path])  # stable: a module's tests stay together, in their order


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
