"""The architecture's rules, checked on the source: no import cycles between our modules (counting every import,
lazy and type-only ones too), scripts import nothing from tests, the scheduler never imports torch, the worker
never imports grpc; and every module is imported by a test of its mirror folder, or says where it is tested."""

from __future__ import annotations

import ast

import pytest

from tests.support.paths import REPO
from tests.support.rooms import (
    LAYER_OF,
    import_graph,
    imports_of,
    mermaid,
    module_name,
    our_modules,
    room_arrows,
    upward,
)

pytestmark = pytest.mark.unit


# The graph (every import of our modules) and the rooms' layers are read by tests/support/rooms.py, which also draws
# docs/design.md's picture of them.
def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_arrow_between_rooms_points_down_a_layer() -> None:
    assert upward(room_arrows(import_graph())) == [], "an import up a layer, or between sibling rooms"


def test_the_layer_check_finds_an_arrow_up_and_one_between_siblings() -> None:
    graph = {
        "worker_node.kv.cache": {"worker_node.models.config", "kernels.kv_quant"},
        "router_node.main": {"clients.client", "scheduler_node.api.health"},
        "proto.wire": set(),
    }
    assert upward(room_arrows(graph)) == ["router_node -> clients", "worker_node.kv -> worker_node.models"]
    assert LAYER_OF["proto"] == 0


def test_design_md_shows_the_rooms_and_arrows_the_code_has() -> None:
    """docs/design.md's picture is `python -m tests.support.rooms`'s output: regenerate it when an arrow changes."""
    assert mermaid(room_arrows(import_graph())) in (REPO / "docs" / "design.md").read_text()


def test_scripts_import_nothing_from_tests() -> None:
    offenders = {
        p.name: sorted(m for m in imports_of(p) if m == "tests" or m.startswith("tests."))
        for p in (REPO / "scripts").glob("*.py")
    }
    assert not {name: mods for name, mods in offenders.items() if mods}


# The bottom layers: proto (the contracts) imports none of ours; settings (the settings tree) only proto, and
# neither torch nor grpc, as the scheduler and the worker both read it (proto's generated gRPC stubs are the
# scheduler side's alone).
BOTTOM = {"proto": {"proto"}, "settings": {"proto", "settings"}}
NEITHER_SIDE = {"settings"}


def layer_breaches(graph: dict[str, set[str]], third_party: dict[str, set[str]]) -> list[str]:
    """`module -> import` for each import of a bottom layer's module outside what its layer may use."""
    found = []
    for name, imports in graph.items():
        allowed = BOTTOM.get(name.split(".")[0])
        if allowed is None:
            continue
        found += [f"{name} -> {m}" for m in sorted(imports) if m.split(".")[0] not in allowed]
        if name.split(".")[0] in NEITHER_SIDE:
            found += [f"{name} -> {m}" for m in sorted(third_party[name]) if m in ("torch", "grpc", "grpc_health")]
    return found


def test_proto_and_settings_are_bottom_layers() -> None:
    modules = our_modules()
    roots = {name: {m.split(".")[0] for m in imports_of(path)} for name, path in modules.items()}
    assert layer_breaches(import_graph(), roots) == []


def test_the_layer_check_finds_a_breach() -> None:
    graph = {"settings.a": {"proto.wire", "scheduler_node.core"}, "proto.b": {"settings.a"}, "minivllm.c": {"x"}}
    roots = {"settings.a": {"torch"}, "proto.b": {"grpc"}, "minivllm.c": {"torch"}}
    assert layer_breaches(graph, roots) == [
        "settings.a -> scheduler_node.core",
        "settings.a -> torch",
        "proto.b -> settings.a",
    ]


def test_the_scheduler_never_imports_torch_and_the_worker_never_imports_grpc() -> None:
    for name, path in our_modules().items():
        roots = {m.split(".")[0] for m in imports_of(path)}
        if name.startswith("scheduler_node"):
            assert "torch" not in roots, f"{name} imports torch"
        if name.startswith("worker_node"):
            assert "grpc" not in roots and "grpc_health" not in roots, f"{name} imports grpc"


# ---- objects own their state

OWNED_PACKAGES = ("scheduler_node/core",)  # composed of objects handed what they use (ARCHITECTURE.md)


def owned_names(tree: ast.AST) -> set[str]:
    """The private names a module owns: attributes it sets on `self`, and what it defines."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def reaches_into_others(source: str) -> list[str]:
    """`obj._name`, read or written, where `_name` is not this module's own: another object's private state, or
    through `self` a base's in another module (mixins sharing private names)."""
    tree = ast.parse(source)
    own = owned_names(tree)
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own
    ]


def test_no_module_of_the_scheduler_core_reaches_into_another_objects_private_state() -> None:
    offenders = {
        str(path.relative_to(REPO)): found
        for package in OWNED_PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if (found := reaches_into_others(path.read_text()))
    }
    assert offenders == {}, "the owner exposes what others need (a method, a property, a prebuilt closure)"


def test_the_private_access_scan_finds_a_reach_into_another_object() -> None:
    source = """
class Table:
    def __init__(self):
        self._free = []

    def steal(self, other):
        return other._free  # the same module's: allowed


class Mixin(Base):
    def pending(self):
        return self._ops  # a base's, in another module: found


def relocate(table):
    table._ref_counts[0] = 1  # another module's: found
    return table.ops._pending, table._free
"""
    found = ["12: self._ops", "16: table._ref_counts", "17: table.ops._pending"]
    assert reaches_into_others(source) == found


# ---- every module has a test in its mirror folder

# Modules no test module of their mirror folder imports, each with where it is tested instead. The check below
# fails for a module missing from this list, and for one listed here that has such a test by now.
TESTED_ELSEWHERE: dict[str, str] = {
    "scheduler_node.core.migration": "a migrated sequence's state (a dataclass), through"
    " tests/scheduler_node/engine/test_migration.py and tests/scheduler_node/api/test_resume.py",
    "kernels.triton_common": "helpers of the Triton kernels, run through kernels.triton_attention by"
    " tests/kernels/test_triton_kernels.py (a GPU, or Triton's interpreter)",
    "kernels.triton_write_kv": "run through kernels.triton_attention by tests/kernels/test_triton_kernels.py",
    "minivllm.lora_request": "re-exported by minivllm/__init__.py, whence tests/minivllm/test_lora.py imports it",
    "minivllm.outputs": "re-exported by minivllm/__init__.py, whence tests/minivllm/test_offline_api.py imports it",
    "minivllm.sampling_params": "re-exported by minivllm/__init__.py, whence tests/minivllm/ imports it",
    "proto.wire_base": "the wire's building blocks, re-exported by proto.wire (tests/proto/test_wire.py)",
    "proto.step_messages": "the step's plan and result, re-exported by proto.wire (tests/proto/test_wire.py)",
    "proto.session_messages": "hand-shake and control messages, re-exported by proto.wire (tests/proto/test_wire.py)",
    "scheduler_node.engine.handoffs": "the engine core's hand-offs: migration through tests/scheduler_node/engine/"
    "test_migration.py, KV leases through tests/fidelity/test_disagg_handoff.py",
    "scheduler_node.engine.live_stats": "the engine core's scrape-time numbers, read by"
    " tests/scheduler_node/engine/test_metrics.py",
    "scheduler_node.engine.intake": "the engine core's intake (submit, abort, drain): every engine test submits"
    " through it, e.g. tests/scheduler_node/engine/test_engine_errors.py",
    "minivllm.model_executor.layers.attention": "the article's `PagedAttention.supports` line, run as written by"
    " tests/minivllm/test_custom_ops.py; the check itself: tests/worker_node/models/test_attention_support.py",
    "minivllm.collect": "LLM.generate's collectors, through tests/minivllm/test_offline_api.py",
    "proto.serving_pb2": "generated from proto/serving.proto by grpcio-tools; every gRPC test speaks it",
    "proto.serving_pb2_grpc": "generated from proto/serving.proto by grpcio-tools; every gRPC test speaks it",
    "scheduler_node.api.openai_guards": "the door's API key and body limit, through its app:"
    " tests/scheduler_node/api/test_openai_server.py",
    "scheduler_node.api.openai_lora": "the door's LoRA routes, through its app:"
    " tests/scheduler_node/api/test_openai_lora.py",
    "scheduler_node.api.openai_runs": "a part of the OpenAI door: tests/scheduler_node/api/test_openai_server.py",
    "clients.bench.load": "a part of vllm-bench, run against a real server by tests/clients/bench/test_bench.py",
    "clients.bench.mixed": "the chaos workload, run by tests/e2e/test_chaos.py",
    "scheduler_node.cli.signals": "the servers' drain on SIGTERM, through vllm-scheduler as a program:"
    " tests/e2e/test_control.py",
    "scheduler_node.engine.failures": "the engine core's failures, in tests/scheduler_node/engine/"
    "test_core.py and test_failed_step.py",
    "scheduler_node.engine.processes": "through scheduler_node.engine.launchers"
    " (tests/scheduler_node/engine/test_launchers.py)",
    "scheduler_node.engine.ray_launcher": "needs ray: tests/e2e/test_ray_launcher.py",
    "router_node.kv_subscriber": "fed by a replica's real publisher in tests/scheduler_node/engine/"
    "test_kv_publisher.py, and through vllm-router in tests/e2e/test_router.py",
    "router_node.strategies": "through router_node.routing (tests/router_node/"
    "test_routing.py) and scripts/bench_router.py --smoke (tests/scripts/test_bench_router.py)",
    "worker_node.models.attention": "the attention metadata, tested with the decode graphs and kernels"
    " (tests/kernels/test_decode_graphs.py)",
    "worker_node.cuda_graphs": "tests/kernels/test_decode_graphs.py (with the kernels it captures)",
    "worker_node.batch_rows": "the InputBatch's arrays, through tests/worker_node/test_input_batch.py (which grows"
    " rows, token and block widths as it goes)",
    "worker_node.forward_pass": "the model runner's forward pass, through every runner test: tests/worker_node/"
    "test_faulted_rows.py, test_step_overlap.py, tests/worker_node/models/test_models.py",
    "worker_node.step_reply": "the model runner's replies, through tests/worker_node/test_step_overlap.py and"
    " test_faulted_rows.py",
    "worker_node.lora_holder": "the runner's LoRA manager, made when a request brings an adapter:"
    " tests/fidelity/test_lora.py",
    "worker_node.loading": "loads a rank as a worker does; tests/support/engine.py's load_runner runs it for every"
    " model test",
    "worker_node.models.gemma2": "registered in worker_node/models/registry.py; tests/worker_node/models/"
    "test_models.py runs every tiny variant against HF",
    "worker_node.models.llama": "registered in worker_node/models/registry.py; tests/worker_node/models/"
    "test_models.py runs every tiny variant against HF",
    "worker_node.models.gguf": "GGUF reading and dequantisation: tests/worker_node/test_model_loading.py",
    "worker_node.structured": "the sampler's grammar matcher, run in the engine by"
    " tests/scheduler_node/api/test_structured.py",
    "worker_node.token_counts": "the penalties' counts, through the sampler: tests/worker_node/"
    "test_logits_processors.py and tests/fidelity/test_sampling_engine.py",
    "worker_node.worker": "the worker process, started by every e2e test; tests/kernels/test_backend.py reads"
    " its flags",
}


def imports_of_tests() -> dict[str, set[str]]:
    """Every test module of the suite, with what it imports."""
    return {module_name(p): imports_of(p) for p in (REPO / "tests").rglob("test_*.py")}


def untested_in_mirror(modules: list[str], tests: dict[str, set[str]]) -> list[str]:
    """The modules no test module of their mirror folder imports: scheduler_node.engine.core needs one under
    tests/scheduler_node/engine/ (a test elsewhere does not count)."""
    missing = []
    for name in modules:
        mirror = "tests." + name.rpartition(".")[0] + "."
        if not any(test.startswith(mirror) and name in imported for test, imported in tests.items()):
            missing.append(name)
    return sorted(missing)


def test_every_module_is_tested_in_its_mirror_folder_or_says_where() -> None:
    modules = [name for name, path in our_modules().items() if path.name != "__init__.py"]
    missing = set(untested_in_mirror(modules, imports_of_tests()))
    assert sorted(missing - set(TESTED_ELSEWHERE)) == [], "add a test in its mirror folder, or list it with a reason"
    assert sorted(set(TESTED_ELSEWHERE) - missing) == [], "tested in its mirror folder now (or gone): unlist it"


def test_the_mirror_check_finds_a_module_tested_only_elsewhere() -> None:
    tests = {
        "tests.pkg.sub.test_a": {"pkg.sub.a"},  # its mirror folder: tested
        "tests.e2e.test_b": {"pkg.sub.b"},  # elsewhere
        "tests.pkg.test_c": {"pkg.sub.c"},  # the folder above its mirror
    }
    modules = ["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.d"]  # d: imported by no test at all
    assert untested_in_mirror(modules, tests) == ["pkg.sub.b", "pkg.sub.c", "pkg.sub.d"]
