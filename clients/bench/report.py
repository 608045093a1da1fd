"""vllm-bench's outputs: a table (one column per request rate), a JSON file, and PNG plots (latency percentiles
and throughput against the request rate; the ITL distribution per rate)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from clients.bench.backends import RequestResult
from clients.bench.results import LATENCIES, PERCENTILES, RunSummary

TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "end to end"}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def table(runs: list[RunSummary]) -> str:
    """A markdown table: one row per figure, one column per request rate."""
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{r.completed} / {r.failed}" for r in runs]),
        ("duration (s)", [f"{r.duration_s:.2f}" for r in runs]),
        ("requests/s", [f"{r.request_throughput:.2f}" for r in runs]),
        ("output tok/s", [f"{r.output_throughput:.1f}" for r in runs]),
        ("total tok/s", [f"{r.total_token_throughput:.1f}" for r in runs]),
    ]
    if runs and runs[0].goodput is not None:
        rows.append(("goodput (req/s)", [f"{r.goodput:.2f}" for r in runs]))
    for name in LATENCIES:
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            rows.append((f"{TITLES[name]} {stat} (ms)", [f"{r.latency_ms[name][stat]:.1f}" for r in runs]))
    header = "| request rate (req/s) | " + " | ".join(rate_label(r.request_rate) for r in runs) + " |"
    lines = [header, "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return "\n".join(lines)


def write_json(path: Path, config: dict[str, Any], runs: list[RunSummary], results: list[list[RequestResult]]) -> None:
    """The settings, each run's summary and every request's timings (seconds); NaN (no data) as null."""
    body = {
        "config": config,
        "runs": [
            {**dataclasses.asdict(run), "requests": [dataclasses.asdict(r) for r in rs]}
            for run, rs in zip(runs, results)
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(body), indent=1))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)  # inf rates as "inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def plot(folder: Path, runs: list[RunSummary], results: list[list[RequestResult]], title: str) -> list[Path]:
    """latency_vs_rate.png and itl_cdf.png in `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    return [_latency_vs_rate(folder / "latency_vs_rate.png", runs, title),
            _itl_cdf(folder / "itl_cdf.png", runs, results, title)]  # fmt: skip


def _latency_vs_rate(path: Path, runs: list[RunSummary], title: str) -> Path:
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    x = list(range(len(runs)))
    labels = [rate_label(r.request_rate) for r in runs]
    for ax, name in zip(axes, LATENCIES):
        for q in PERCENTILES:
            ax.plot(x, [r.latency_ms[name][f"p{q}"] for r in runs], marker="o", label=f"P{q}")
        ax.set_title(f"{TITLES[name]} (ms)")
    axes[4].plot(x, [r.output_throughput for r in runs], marker="o", label="output")
    axes[4].plot(x, [r.total_token_throughput for r in runs], marker="o", label="input + output")
    axes[4].set_title("throughput (tokens/s)")
    axes[5].plot(x, [r.request_throughput for r in runs], marker="o", label="completed")
    if runs and runs[0].goodput is not None:
        axes[5].plot(x, [r.goodput for r in runs], marker="o", label="within SLOs (goodput)")
    axes[5].set_title("requests/s")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path


def _itl_cdf(path: Path, runs: list[RunSummary], results: list[list[RequestResult]], title: str) -> Path:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for run, rs in zip(runs, results):
        gaps = sorted(1000 * g for r in rs if r.ok for g in r.itl)
        if gaps:
            ax.plot(
                gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=f"{rate_label(run.request_rate)} req/s"
            )
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps ≤ x")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"ITL distribution — {title}")
    fig.savefig(path, dpi=110)
    return path


def bar_panels(path: Path, labels: list[str], panels: list[tuple[list[float], str]], dpi: int = 120) -> Path:
    """A row of bar charts over the same `labels`, one per (values, y label): the benchmark scripts' summary plot."""
    fig = Figure(figsize=(4.5 * len(panels), 3), layout="constrained")
    for ax, (values, ylabel) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        ax.bar(labels, values)
        ax.set_ylabel(ylabel)
    fig.savefig(path, dpi=dpi)
    return path
