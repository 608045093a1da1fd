"""The Triton kernels compile for a GPU, here, without one: Triton's interpreter (the other kernel tests) runs a
kernel's Python but never lowers it, so a kernel only the GPU compiler refuses (a global that is not a
constexpr, branches whose types disagree, a conversion the target lacks) would pass every CPU test. Every kernel
over an fp8 cache, and the int8 write, is compiled for sm_90 down to a cubin with Triton's bundled ptxas
(tests/support/gpu_compile.py, in a process of its own, since this session runs Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.gpu_compile"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["write_kv int8", "write_kv fp8_e4m3", "decode fp8_e4m3", "prefill fp8_e4m3"])
def test_kernel_compiles_for_sm90(compiled: dict[str, object], launch: str) -> None:
    assert compiled[launch] == "ok"


@pytest.mark.slow
def test_only_the_fp8_write_converts_to_e4m3_in_hardware(compiled: dict[str, object]) -> None:
    """The fp8 store is the hardware's saturating conversion (its operand already on the e4m3 grid), and the
    readers convert e4m3 up, never down."""
    converting = {key for key, value in compiled.items() if key.endswith("converts to e4m3") and value is True}
    assert converting == {"write_kv fp8_e4m3 converts to e4m3"}
