"""The house's rooms (packages) and the imports between them, read from the source.

Prints the picture docs/design.md shows under "Rooms and arrows" (a Mermaid flowchart: rooms as boxes, imports as
arrows, each with how many module imports it stands for); tests/test_layout.py checks that the picture in the doc
is the one the code draws now and that every arrow points down the layers below.

    python -m tests.support.rooms            # the Mermaid block
    python -m tests.support.rooms --check    # exit 1, naming the arrows, when an import points up a layer
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Bottom to top: a room may import the rooms of lower layers and its own, never one of its layer or above. Rooms of
# one layer are siblings that do not know each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("proto",),  # the contracts between processes
    ("settings",),  # every setting, once; reads only proto
    ("kernels",),  # attention and matmul kernels: torch, Triton, C
    ("worker_node.runtime",),  # process groups, attention metadata, host copies: what the worker's parts stand on
    ("worker_node.kv",),  # the cache, its tiers, transfer between workers, hand-off between replicas
    ("worker_node.models",),  # the model families and their quantized layers; they write the KV cache
    ("worker_node.lora",),  # adapters over the models' layers
    ("worker_node",),  # the worker process: plan loop, model runner, sampler
    ("scheduler_node.text",),
    ("scheduler_node.core",),  # the scheduler: no torch, no grpc
    ("scheduler_node.engine",),  # the loop that sends plans; may start a worker in-process or as a Ray actor
    ("scheduler_node.api",),  # the doors
    ("scheduler_node.cli",),  # vllm-scheduler and vllm-serve
    ("router_node", "clients"),  # vllm-router; vllm-client, vllm-monitor, vllm-bench
    ("minivllm",),  # the public Python API
)
PACKAGES = ("proto", "settings", "kernels", "worker_node", "scheduler_node", "router_node", "clients", "minivllm")
LAYER_OF = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it (top level, functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Each of our modules with the modules of ours it imports."""
    modules = our_modules()
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def room_of(module: str) -> str:
    """The deepest room of LAYERS that holds `module` (worker_node.kv.cache: worker_node.kv)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER_OF:
            return ".".join(parts[:n])
    raise KeyError(f"{module} is in no room of tests/support/rooms.py's LAYERS")


def room_arrows(graph: dict[str, set[str]]) -> Counter[tuple[str, str]]:
    """(room, room it imports) -> how many module imports that arrow stands for."""
    arrows: Counter[tuple[str, str]] = Counter()
    for name, imports in graph.items():
        for imported in imports:
            a, b = room_of(name), room_of(imported)
            if a != b:
                arrows[(a, b)] += 1
    return arrows


def upward(arrows: Counter[tuple[str, str]]) -> list[str]:
    """Arrows that do not point to a lower layer: to a sibling, or up."""
    return sorted(f"{a} -> {b}" for a, b in arrows if LAYER_OF[b] >= LAYER_OF[a])


def _node(room: str) -> str:
    return room.replace(".", "_")


def mermaid(arrows: Counter[tuple[str, str]]) -> str:
    """A Mermaid flowchart: one box per room (top layer first), one arrow per room pair with its import count."""
    lines = ["```mermaid", "flowchart TD"]
    for level in reversed(range(len(LAYERS))):
        lines += [f'    {_node(room)}["{room}"]' for room in LAYERS[level]]
    for (a, b), count in sorted(arrows.items(), key=lambda kv: (-LAYER_OF[kv[0][0]], kv[0])):
        lines.append(f"    {_node(a)} -->|{count}| {_node(b)}")
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when an import points up a layer")
    args = parser.parse_args(argv)
    arrows = room_arrows(import_graph())
    if args.check:
        bad = upward(arrows)
        print("\n".join(bad) or "every arrow points down")
        return 1 if bad else 0
    print(mermaid(arrows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
