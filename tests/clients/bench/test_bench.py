"""vllm-bench: arrival processes, workloads and summaries on their own; a tiny rate sweep end to end against a real
server over both doors (JSON and PNGs written; the same workload gives the same tokens through gRPC and HTTP)."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from clients.bench import main as bench
from clients.bench.backends import OpenAIBackend, RequestResult, SendOptions
from clients.bench.results import parse_slos, percentile, summarize
from clients.bench.workload import (
    BenchRequest,
    Lengths,
    arrival_times,
    jsonl_requests,
    prefix_requests,
    random_requests,
)
from minivllm.cluster import REPO, Cluster
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.clusters import serving

pytestmark = pytest.mark.e2e

PNG = b"\x89PNG\r\n\x1a\n"


def gaps(rate: float, burstiness: float) -> list[float]:
    times = arrival_times(4000, rate, burstiness, seed=3)
    return [b - a for a, b in zip(times, times[1:])]


def test_arrivals_keep_the_rate_and_burstiness_shapes_them() -> None:
    assert arrival_times(5, math.inf, 1.0, 0) == [0.0] * 5
    for burstiness in (0.25, 1.0, 4.0):
        g = gaps(10.0, burstiness)
        assert statistics.mean(g) == pytest.approx(0.1, rel=0.1)
        cv = statistics.stdev(g) / statistics.mean(g)  # gamma: 1 / sqrt(shape)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.15), burstiness
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0, 1.0, 0)


def test_length_distributions() -> None:
    rng = random.Random(0)
    uniform = [Lengths(100, "uniform", 0.5).sample(rng) for _ in range(2000)]
    assert min(uniform) >= 50 and max(uniform) <= 150 and statistics.mean(uniform) == pytest.approx(100, rel=0.05)
    lognormal = [Lengths(100, "lognormal", 0.8).sample(rng) for _ in range(4000)]
    assert statistics.mean(lognormal) == pytest.approx(100, rel=0.1) and max(lognormal) > 250
    assert {Lengths(7, "fixed", 0.9).sample(rng) for _ in range(10)} == {7}
    with pytest.raises(ValueError, match="spread"):
        Lengths(10, "uniform", 1.0)


def test_random_prefix_and_jsonl_workloads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tokenizer = ModelTokenizer(tiny_llama_dir)
    specials = set(tokenizer.tokenizer.get_added_tokens_decoder())
    rand = random_requests(tokenizer, 20, Lengths(32, "uniform", 0.25), Lengths(8), seed=1)
    assert all(24 <= len(r.prompt_ids or []) <= 40 and r.output_len == 8 for r in rand)
    assert not specials & {t for r in rand for t in r.prompt_ids or []}
    assert rand == random_requests(tokenizer, 20, Lengths(32, "uniform", 0.25), Lengths(8), seed=1)
    mixed = prefix_requests(tokenizer, 6, 16, 2, Lengths(4), Lengths(8), seed=1)
    heads = [tuple((r.prompt_ids or [])[:16]) for r in mixed]
    assert heads[0::2] == [heads[0]] * 3 and heads[1::2] == [heads[1]] * 3 and heads[0] != heads[1]
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    rows = jsonl_requests(path, 3, Lengths(5), seed=0)
    assert [(r.text, r.output_len) for r in rows] == [("hello", 3), ("", 5), ("hello", 3)]
    assert rows[1].messages == [{"role": "user", "content": "hi"}]
    path.write_text('{"prompt": "ok"}\n{"text": 1}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:2"):
        jsonl_requests(path, 2, Lengths(5), seed=0)


def test_openai_bodies_carry_ids_text_or_messages() -> None:
    request = BenchRequest(4, prompt_ids=[5, 6], text="five six")
    backend = OpenAIBackend("http://x/v1", model="m")
    body = backend.body(request, SendOptions())
    assert (body["prompt"], body["max_tokens"], body["ignore_eos"], body["stream_options"]) == (
        [5, 6], 4, True, {"include_usage": True})  # fmt: skip
    assert OpenAIBackend("http://x/v1", "m", send_text=True).body(request, SendOptions())["prompt"] == "five six"
    chat = backend.body(request, SendOptions(endpoint="chat", ignore_eos=False))
    assert chat["messages"] == [{"role": "user", "content": "five six"}] and "ignore_eos" not in chat


def test_summary_figures_and_goodput() -> None:
    results = [
        RequestResult(True, prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(True, prompt_len=20, output_len=3, ttft=0.3, latency=1.3, itl=[0.5, 0.5]),
        RequestResult(False, error="HTTP 503: draining"),
    ]
    s = summarize(2.0, results, duration=2.0, slos=parse_slos(["ttft:200", "tpot:200"]))
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (2, 1, 30, 8)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput) == (1.0, 4.0, 19.0)
    assert s.goodput == 0.5  # the second request's TTFT (300 ms) misses its SLO
    assert s.latency_ms["tpot"]["mean"] == pytest.approx(1000 * (0.1 + 0.5) / 2)
    assert s.latency_ms["ttft"]["p50"] == pytest.approx(200.0)
    assert s.latency_ms["itl"]["p99"] == pytest.approx(500.0)
    assert s.errors == ["HTTP 503: draining"]
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        parse_slos(["itl:5"])


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    with serving(
        Cluster(tiny_llama_dir, ["--no-enable-prefix-caching"], ["--kv-cache-memory", "16MiB"], http=True)
    ) as c:
        yield c


def test_a_sweep_writes_json_and_plots(cluster: Cluster, tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run.json"
    code = bench.main([
        "--base-url", cluster.base_url, "--tokenizer", str(tiny_llama_dir), "--request-rate", "20,inf",
        "--num-prompts", "6", "--input-len", "12", "--output-len", "6", "--range-ratio", "0.5",
        "--goodput", "ttft:60000", "e2el:60000", "--json", str(out), "--plot", str(tmp_path / "plots"), "--no-progress",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| request rate (req/s) | 20 | inf |" in printed and "goodput (req/s)" in printed
    report = json.loads(out.read_text())
    assert [run["request_rate"] for run in report["runs"]] == [20.0, "inf"]
    tokenizer = ModelTokenizer(tiny_llama_dir)
    for seed, run in enumerate(report["runs"]):  # rate i: prompts from seed i
        sent = random_requests(tokenizer, 6, Lengths(12, "uniform", 0.5), Lengths(6, "uniform", 0.5), seed)
        lengths = [r.output_len for r in sent]
        assert (run["completed"], run["failed"]) == (6, 0)
        assert [r["output_len"] for r in run["requests"]] == lengths  # ignore_eos: every output ran its length
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # SLOs of a minute: all met
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats = run["latency_ms"][name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    for name in ("latency_vs_rate.png", "itl_cdf.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG


def test_both_doors_run_the_same_workload(cluster: Cluster, tiny_llama_dir: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text('{"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5}\n{"prompt": "Say"}\n')
    common = ["--tokenizer", str(tiny_llama_dir), "--num-prompts", "4", "--output-len", "4", "--no-progress"]
    runs: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for door in (["--backend", "grpc", "--grpc-address", cluster.address], ["--base-url", cluster.base_url]):
        for workload in (["--dataset", "prefix", "--prefix-len", "8", "--input-len", "4"],
                         ["--dataset", "jsonl", "--dataset-path", str(dataset), "--endpoint", "chat"]):  # fmt: skip
            out = tmp_path / f"{door[1]}-{workload[1]}.json"
            assert bench.main([*door, *workload, *common, "--json", str(out)]) == 0
            run = json.loads(out.read_text())["runs"][0]
            runs[door[1], workload[1]] = [(r["prompt_len"], r["output_len"]) for r in run["requests"]]
    for kind in ("prefix", "jsonl"):
        assert runs["grpc", kind] == runs[cluster.base_url, kind], kind
    assert [out for _, out in runs["grpc", "jsonl"]] == [5, 4, 5, 4]


def test_the_door_comparison_benchmark_smoke(tiny_llama_dir: Path) -> None:
    """scripts/bench_openai.py --smoke: both doors run the workload to the same tokens and it prints the ratio
    (the figure itself is measured, not asserted: see docs/benchmarks.md)."""
    out = subprocess.run([sys.executable, "scripts/bench_openai.py", "--smoke", "--model", str(tiny_llama_dir),
                          "--threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| gRPC |" in out.stdout and "| OpenAI HTTP |" in out.stdout and "HTTP / gRPC" in out.stdout
