"""`--kv-offload-disk` is checked by trying it: a folder this process can write in (created when missing), else one
line naming the flag. (A read-only mount: tests/e2e/test_offload.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.worker_flags import offload_dir_problem

pytestmark = pytest.mark.unit


def test_a_writable_folder_is_taken_and_a_missing_one_created(tmp_path: Path) -> None:
    assert offload_dir_problem(str(tmp_path)) == ""
    nested = tmp_path / "a" / "b"
    assert offload_dir_problem(str(nested)) == "" and nested.is_dir()
    assert list(nested.iterdir()) == [], "the probe leaves nothing behind"


def test_a_file_or_a_folder_under_a_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("x")
    assert offload_dir_problem(str(file)) == f"--kv-offload-disk {file}: not a folder"
    assert offload_dir_problem(str(file / "sub"), "kv_offload_disk:").startswith(f"kv_offload_disk: {file}/sub: ")
