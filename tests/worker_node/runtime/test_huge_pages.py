"""Weights moved onto transparent huge pages where they lie (worker_node/runtime/huge_pages.py)."""

from __future__ import annotations

import ctypes
import os
import platform
import re
from pathlib import Path

import pytest
import torch

from worker_node.runtime import huge_pages
from worker_node.runtime.huge_pages import HUGE_PAGE

pytestmark = pytest.mark.unit

MiB = 1 << 20


def _kernel_collapses() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not turned off."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if platform.system() != "Linux" or not thp.exists() or "[never]" in thp.read_text():
        return False
    major, minor = (int(n) for n in re.findall(r"\d+", platform.release())[:2])
    return (major, minor) >= (6, 1)


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_ranges_are_the_huge_pages_inside_the_tensors_side_by_side_ones_merged() -> None:
    class Fake:
        def __init__(self, start: int, size: int) -> None:
            self.device = torch.device("cpu")
            self._storage = type("S", (), {"data_ptr": lambda _: start, "nbytes": lambda _: size})()

        def untyped_storage(self) -> object:
            return self._storage

    base = 1000 * HUGE_PAGE
    tensors = [
        Fake(base + 100, 3 * HUGE_PAGE),  # [base+100, base+3H+100): whole pages H..3H
        Fake(base + 3 * HUGE_PAGE + 200, HUGE_PAGE),  # a few bytes on: one run with the first, to 4H+200
        Fake(base + 3 * HUGE_PAGE + 200, HUGE_PAGE),  # a view of the same storage: counted once
        Fake(base + 10 * HUGE_PAGE + 1, HUGE_PAGE),  # far off and under two pages: no whole page inside
    ]
    assert huge_pages._ranges(tensors) == [(base + HUGE_PAGE, base + 4 * HUGE_PAGE)]  # type: ignore[arg-type]


def _skip_unless_the_kernel_collapses_now() -> None:
    """Skip where this kernel cannot collapse memory at all, or has no free huge page now (a fragmented host:
    MADV_COLLAPSE then fails with EAGAIN or ENOMEM, and the engine just runs on small pages)."""
    if not _kernel_collapses():
        pytest.skip("MADV_COLLAPSE needs Linux 6.1+ with transparent huge pages not 'never'")
    probe = torch.ones(4 * MiB, dtype=torch.uint8)
    start = -(-probe.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    madvise = huge_pages._madvise()
    assert madvise is not None
    if madvise(start, HUGE_PAGE, huge_pages.MADV_COLLAPSE) != 0:
        pytest.skip(f"the kernel collapses nothing now: {os.strerror(ctypes.get_errno())}")


def test_a_written_tensor_is_collapsed_onto_huge_pages_in_place() -> None:
    _skip_unless_the_kernel_collapses_now()
    weight = torch.arange(16 * MiB // 4, dtype=torch.float32)
    before = weight.clone()
    address = weight.data_ptr()
    assert huge_pages.collapse([weight]) >= 14 * MiB  # all but the partial pages at both ends
    assert _huge_bytes_at(address + 8 * MiB) >= 14 * MiB
    assert weight.data_ptr() == address and torch.equal(weight, before)


class _Layer(torch.nn.Linear):
    """A layer that keeps tensors beside its parameters, as a QuantLinear (`kernel`) and an LM head (`int8`) do."""

    def __init__(self, kernel: dict[str, object], int8: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(4, 4)
        self.kernel, self.int8 = kernel, int8


def test_a_model_s_tensors_include_what_its_modules_keep_beside_parameters() -> None:
    codes, head_codes, head_scales = torch.zeros(3), torch.zeros(2), torch.zeros(1)
    layer = _Layer({"codes": codes, "note": "not a tensor"}, (head_codes, head_scales))
    found = {t.data_ptr() for t in huge_pages.module_tensors(torch.nn.Sequential(layer))}
    assert found == {t.data_ptr() for t in (layer.weight, layer.bias, codes, head_codes, head_scales)}
