"""Compiled attention libraries for the custom-kernel tests: deploy/custom_attention_kernel.c built with gcc into a
test's folder, and small broken ones, each built from C text."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from kernels.native_build import compiler
from tests.support.paths import REPO

EXAMPLE = REPO / "deploy" / "custom_attention_kernel.c"
HEADERS = REPO / "kernels" / "csrc"  # custom_attention_abi.h


def build_library(source: Path | str, target: Path, *defines: str) -> Path:
    """`source` (a C file, or C text) compiled into the shared library `target` (-D`defines`); skips the test
    where there is no C compiler."""
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler")
    if isinstance(source, str):
        path = target.with_suffix(".c")
        path.write_text(source)
        source = path
    flags = [f"-D{d}" for d in defines]
    command = [cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", f"-I{HEADERS}", *flags, str(source), "-o"]
    subprocess.run([*command, str(target), "-lm"], check=True, capture_output=True)
    return target


def build_example(folder: Path, *defines: str) -> Path:
    """The example library in `folder` (a name of its own per build: a loaded library is never loaded again)."""
    name = "example" + "".join(f"_{d.lower()}" for d in defines) + ".so"
    return build_library(EXAMPLE, folder / name, *defines)


def counter(library: Path, name: str) -> int:
    """An exported int64 of the loaded library `library` (the example's call counters): dlopen hands back the
    handle minivllm loaded, so this reads the same variable."""
    return ctypes.c_int64.in_dll(ctypes.CDLL(str(library)), name).value
