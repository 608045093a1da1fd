"""The CPU fast paths' environment switches are settings (settings/fast_paths.py): each listed in the tree with its
variable, read where settings are read (a command's start, `LLM(...)`), never deep in a kernel, and handed to the
rank as it loads (worker_node/loading.py)."""

from __future__ import annotations

import pytest

from kernels import cpu_gemm, cpu_isa
from settings.engine_args import engine_settings
from settings.fast_paths import FastPaths, act_bits_overrides
from settings.setting import walk
from tests.support.paths import REPO
from worker_node.loading import set_kernel_switches
from worker_node.models import quant_int8
from worker_node.worker import build_parser as worker_parser

pytestmark = pytest.mark.unit

SWITCHES = {
    "MINIVLLM_CPU_GEMM": "cpu_gemm",
    "MINIVLLM_CPU_ISA": "cpu_isa",
    "MINIVLLM_NATIVE_DECODE": "native_decode",
    "MINIVLLM_HUGE_PAGES": "huge_pages",
    "MINIVLLM_INT8_ACT_BITS": "int8_act_bits",
    "MINIVLLM_DECODE_PHASES": "decode_phases",
}
PACKAGES = ("proto", "scheduler_node", "worker_node", "kernels", "minivllm")


def test_every_switch_is_a_setting_with_its_variable() -> None:
    assert {e.spec.env: e.name for e in walk(FastPaths)} == SWITCHES


def test_no_module_reads_a_switch_itself() -> None:
    readers = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if any(env in path.read_text() for env in SWITCHES)
    ]
    assert readers == []


def test_a_variable_sets_the_default_where_settings_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", "0")
    monkeypatch.setenv("MINIVLLM_INT8_ACT_BITS", "down_proj=8")
    assert engine_settings({}).worker.fast_paths == FastPaths(cpu_gemm=False, int8_act_bits="down_proj=8")
    assert engine_settings({"cpu_gemm": True}).worker.fast_paths.cpu_gemm, "a keyword wins"
    args = worker_parser().parse_args([])
    assert (args.cpu_gemm, args.int8_act_bits) == (False, "down_proj=8")
    assert worker_parser().parse_args(["--cpu-gemm"]).cpu_gemm, "a flag wins"


def test_a_bad_variable_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("MINIVLLM_INT8_ACT_BITS", "4")
    with pytest.raises(ValueError, match=r"\$MINIVLLM_INT8_ACT_BITS: int8_act_bits: '4' is not BITS"):
        engine_settings({})
    with pytest.raises(SystemExit):
        worker_parser()
    assert "$MINIVLLM_INT8_ACT_BITS" in capsys.readouterr().err


def test_act_bits_name_projections_and_bits() -> None:
    assert act_bits_overrides("8") == dict.fromkeys(quant_int8.ACT_BITS, 8)
    assert act_bits_overrides("qkv_proj=8, down_proj=16") == {"qkv_proj": 8, "down_proj": 16}
    with pytest.raises(ValueError, match="lm_head=8"):
        FastPaths(int8_act_bits="lm_head=8")


def test_a_rank_sets_the_kernels_switches_as_it_loads() -> None:
    try:
        set_kernel_switches(FastPaths(cpu_gemm=False, int8_act_bits="o_proj=8", cpu_isa="avx2"))
        assert not cpu_gemm.enabled() and cpu_gemm.load() is None
        assert quant_int8.act_bits() == {**quant_int8.ACT_BITS, "o_proj": 8}
        assert cpu_isa.current() == cpu_isa.best("avx2"), "the ceiling: AVX2 at most"
    finally:
        set_kernel_switches(FastPaths())
    assert cpu_gemm.enabled() and quant_int8.act_bits() == quant_int8.ACT_BITS
    assert cpu_isa.current() == cpu_isa.best()


def test_the_isa_choices_are_the_kernels() -> None:
    """settings/fast_paths.py keeps its own copy of kernels/cpu_isa.py's names (settings import no kernels)."""
    assert FastPaths.__dataclass_fields__["cpu_isa"].metadata  # a setting
    from settings.fast_paths import CPU_ISAS

    assert CPU_ISAS == cpu_isa.CHOICES
    with pytest.raises(ValueError, match="cpu_isa"):
        FastPaths(cpu_isa="avx9000")
