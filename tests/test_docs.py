"""The design documents in docs/ stay true to the tree: every repository path they put in backticks exists, and
every `--flag` they name is a flag of some command in pyproject's [project.scripts]."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
TOP_LEVEL = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def repository_paths(text: str) -> list[str]:
    """Code spans that name a file or folder of the repository (`a/b.py`, `a/b.py:Class`, `deploy/*/x.yaml`)."""
    paths = []
    for span in CODE_SPAN.findall(text):
        candidate = span.split("::")[0].split(":")[0].rstrip("/")
        if " " in candidate or candidate.split("/")[0] not in TOP_LEVEL:
            continue
        if "/" in candidate or "." in candidate:
            paths.append(candidate)
    return paths


def path_exists(path: str) -> bool:
    return any(REPO.glob(path)) if "*" in path else (REPO / path).exists()


def all_flags() -> set[str]:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    flags: set[str] = set()
    for target in scripts.values():
        parser: argparse.ArgumentParser = importlib.import_module(target.split(":")[0]).build_parser()
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
    return flags


def test_there_is_a_design_document_and_the_readme_links_it() -> None:
    assert REPO / "docs" / "design.md" in DOCS
    assert "docs/design.md" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_backticked_path_exists(doc: Path) -> None:
    paths = repository_paths(doc.read_text())
    assert paths, f"{doc.name} names no repository path"
    assert [p for p in paths if not path_exists(p)] == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_named_is_a_flag_of_some_command(doc: Path) -> None:
    known = all_flags()
    assert sorted(set(FLAG.findall(doc.read_text())) - known) == []


def test_the_checks_can_fail() -> None:
    text = "see `scheduler_node/engine/core.py`, `deploy/topology/*.yaml`, `no_such_dir/x.py` and `a b`"
    assert repository_paths(text) == ["scheduler_node/engine/core.py", "deploy/topology/*.yaml"]
    assert not path_exists("scheduler_node/engine/no_such_module.py")
    assert "--no-such-flag" not in all_flags()
    assert {"--step-timeout", "--no-async-scheduling", "--scheduler-address"} <= all_flags()
