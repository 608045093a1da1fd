"""The wire codec (proto/wire.py: msgspec Structs) against an older revision's hand-written one, on the plans and
results of steady decode steps: encode and decode time and bytes per request.

The older codec is read from git (`--against`, default the last hand-written one, wire v4) and runs on its own
plan shape: string request ids (uuid hex, as the doors make them, or short ones as integer handles would be
spelled in it), a `num_scheduled_tokens` map beside the cached requests. Times are the thread's CPU time, best of
`--repeats`.

    .venv/bin/python scripts/bench_wire.py [--against REV] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proto import wire  # noqa: E402


def load_revision(rev: str) -> ModuleType:
    """proto/wire.py as it was at `rev`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:proto/wire.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "wire_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("wire_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["wire_old"] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def current_messages(n: int, context: int) -> tuple[Any, Any]:
    plan = wire.StepPlan(7, cached_requests=[wire.CachedRequest(h, context + h % 50, 1) for h in range(n)])
    result = wire.StepResult(7, {h: [1000 + h] for h in range(n)}, execute_ms=12.5)
    return plan, result


def old_messages(old: ModuleType, n: int, context: int, ids: list[str]) -> tuple[Any, Any]:
    plan = old.StepPlan(
        7,
        cached_requests=[old.CachedRequest(ids[i], [], context + i % 50) for i in range(n)],
        num_scheduled_tokens={r: 1 for r in ids},
    )
    result = old.StepResult(7, {r: [1000 + i] for i, r in enumerate(ids)}, execute_ms=12.5)
    return plan, result


def best_us(fn: Callable[[], Any], repeats: int, inner: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - start) / inner)
    return best * 1e6


def measure(name: str, codec: Any, plan: Any, result: Any, n: int, repeats: int, inner: int) -> dict:
    data, back = codec.encode(plan), codec.encode(result)
    return {
        "codec": name,
        "requests": n,
        "plan_encode_us": best_us(lambda: codec.encode(plan), repeats, inner),
        "plan_decode_us": best_us(lambda: codec.decode(data), repeats, inner),
        "result_encode_us": best_us(lambda: codec.encode(result), repeats, inner),
        "result_decode_us": best_us(lambda: codec.decode(back), repeats, inner),
        "plan_bytes_per_request": len(data) / n,
        "result_bytes_per_request": len(back) / n,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="76a0246", help="the git revision whose proto/wire.py is compared")
    p.add_argument("--requests", default="256,1024", help="decode requests per plan, comma-separated")
    p.add_argument("--context", type=int, default=1000, help="each request's computed tokens (sets int widths)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds; the best counts")
    p.add_argument("--smoke", action="store_true", help="one small size, few rounds (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.repeats = "32", 2
    old = load_revision(args.against)
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        inner = max(3, 20_000 // n)
        plan, result = current_messages(n, args.context)
        rows.append(measure("msgspec Structs, integer handles", wire, plan, result, n, args.repeats, inner))
        for label, ids in (
            ("hand-written, uuid ids", [uuid.uuid4().hex for _ in range(n)]),
            ("hand-written, short ids", [str(i) for i in range(n)]),
        ):
            plan, result = old_messages(old, n, args.context, ids)
            rows.append(measure(label, old, plan, result, n, args.repeats, inner))
    header = ["codec", "requests", "plan encode", "plan decode", "result encode", "result decode", "plan B/req"]
    print("| " + " | ".join([*header, "result B/req"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['codec']} | {r['requests']} | {r['plan_encode_us']:.0f} µs | {r['plan_decode_us']:.0f} µs "
            f"| {r['result_encode_us']:.0f} µs | {r['result_decode_us']:.0f} µs "
            f"| {r['plan_bytes_per_request']:.1f} | {r['result_bytes_per_request']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
