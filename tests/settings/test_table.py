"""docs/settings.md is the table the tree prints (settings/table.py): a setting added, changed or removed without
regenerating it fails here."""

from __future__ import annotations

import pytest

from settings.table import render
from tests.support.paths import REPO

pytestmark = pytest.mark.unit


def test_the_committed_table_is_the_generated_one() -> None:
    committed = (REPO / "docs" / "settings.md").read_text()
    assert committed == render(), "regenerate it: python -m settings.table > docs/settings.md"


def test_every_setting_has_a_row() -> None:
    text = render()
    for flag in ("--max-num-seqs", "--kv-cache-memory", "--cpu-gemm", "--replica", "--goodput", "--metric"):
        assert f"| `{flag}`" in text, flag
    assert "`schedule_gc` (no flag)" in text
    assert "`--cpu-gemm` `$MINIVLLM_CPU_GEMM`" in text
