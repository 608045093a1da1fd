"""The documents (README.md and docs/) stay true to the tree: every repository path they put in backticks exists,
and every `--flag` they name is a flag of some command in pyproject's [project.scripts] or of a script under
scripts/, unless another program's name comes right before it (`docker run --rm`, `kubectl ... --from-file`)."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import tomllib

from tests.support.paths import REPO

pytestmark = pytest.mark.unit

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_LEVEL = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Programs whose own flags the documents show: a flag belongs to the nearest program named before it on its line.
OTHER_PROGRAMS = (
    "docker",
    "kubectl",
    "helm",
    "ray start",
    "systemctl",
    "systemd-analyze",
    "pip install",
    "llama-server",
    "nccl-test",  # the articles' own tools (docs/guide.md "From the articles")
    "dify-server",
)
OURS = re.compile(r"(?<![\w-])vllm-[a-z]+|scripts/[\w/]+\.py")
OTHER = re.compile(r"(?<![\w-])(?:" + "|".join(re.escape(p) for p in OTHER_PROGRAMS) + ")")
SCRIPT_FLAG = re.compile(r'add_argument\(\s*"(--[a-z][a-z0-9-]*)"')


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
    for script in (REPO / "scripts").glob("*.py"):
        flags.update(SCRIPT_FLAG.findall(script.read_text()))
    return flags


def flags_of_ours(text: str) -> set[str]:
    """The flags of a text, less those that follow another program's name more closely than one of ours."""
    found: set[str] = set()
    for line in text.replace("\\\n", " ").splitlines():
        for match in FLAG.finditer(line):
            before = line[: match.start()]
            other = max((m.end() for m in OTHER.finditer(before)), default=-1)
            ours = max((m.end() for m in OURS.finditer(before)), default=-1)
            if other <= ours:
                found.add(match.group())
    return found


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
    assert sorted(flags_of_ours(doc.read_text()) - known) == []


def test_the_checks_can_fail() -> None:
    text = "see `scheduler_node/engine/core.py`, `deploy/topology/*.yaml`, `no_such_dir/x.py` and `a b`"
    assert repository_paths(text) == ["scheduler_node/engine/core.py", "deploy/topology/*.yaml"]
    assert not path_exists("scheduler_node/engine/no_such_module.py")
    assert "--no-such-flag" not in all_flags()
    text = "docker run --rm img vllm-serve --host x --bogus\nkubectl --from-file=a"
    assert flags_of_ours(text) == {"--host", "--bogus"}
    assert {"--step-timeout", "--no-async-scheduling", "--scheduler-address"} <= all_flags()
