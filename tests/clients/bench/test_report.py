"""The benchmark scripts' summary plot: one bar chart per panel, side by side, written as a PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from clients.bench.report import bar_panels

pytestmark = pytest.mark.unit


def test_bar_panels_draws_one_chart_per_panel(tmp_path: Path) -> None:
    labels = ["colocated", "disaggregated"]
    one = bar_panels(tmp_path / "one.png", labels, [([1.0, 2.0], "tok/s")], dpi=50)
    two = bar_panels(tmp_path / "two.png", labels, [([1.0, 2.0], "tok/s"), ([0.5, 0.1], "ITL P99 (s)")], dpi=50)
    h1, w1, _ = matplotlib.image.imread(one).shape
    h2, w2, _ = matplotlib.image.imread(two).shape
    assert (h1, w1) == (150, 225) and (h2, w2) == (150, 450)
