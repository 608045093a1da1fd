"""Objects own their state: in the engine (scheduler_node/engine) and the worker (worker_node), no code reads or
writes another object's private name (`x._name` where x is not `self` or `cls`). A collaborator that needs
something of another is handed it, or the owner exposes it under a public name. The few exceptions are other
libraries' private names the code needs (torch, ctypes, os): each is listed below with why."""

from __future__ import annotations

import ast

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.unit

SCANNED = ("scheduler_node/engine", "worker_node")

# (file, the expression as ast.unparse writes it) -> why it may reach a private name.
ALLOWED: dict[tuple[str, str], str] = {
    ("worker_node/plan_loop.py", "os._exit"): "the documented way out of a process without running its cleanup",
    (
        "worker_node/runtime/huge_pages.py",
        "ctypes._CFuncPtr",
    ): "the type of a loaded C function, for an annotation: ctypes has no public name for it",
    ("worker_node/kv/transfer/staging.py", "torch.cuda._lazy_init"): "CUDA IPC handles need the context made first;"
    " torch exposes no public call that makes it",
    ("worker_node/kv/transfer/staging.py", "torch.UntypedStorage._new_shared_cuda"): "torch's CUDA IPC (what"
    " torch.multiprocessing uses), with no public spelling",
    (
        "worker_node/kv/transfer/staging.py",
        "tensor.untyped_storage()._share_cuda_",
    ): "the exporting side of the same CUDA IPC",
    ("worker_node/models/layers.py", "down._forward_hooks"): "whether anyone hooks the module (a hook must see the"
    " module run, so a fused path stays off); torch.nn.Module has no public query",
    ("worker_node/models/layers.py", "down._forward_pre_hooks"): "the same, for pre-hooks",
    ("worker_node/models/native_decode.py", "m._forward_hooks"): "the same: hooked layers keep the torch path",
    ("worker_node/models/native_decode.py", "m._forward_pre_hooks"): "the same, for pre-hooks",
    ("worker_node/models/quant_awq.py", "torch.ops.aten._convert_weight_to_int4pack_for_cpu"): "torch's int4 CPU"
    " kernel has only this (private) spelling",
    ("worker_node/models/quant_awq.py", "torch.ops.aten._weight_int4pack_mm_for_cpu"): "the same kernel's matmul",
    ("worker_node/models/quant_awq.py", "layer._buffers"): "a registered buffer swapped for its repacked form or"
    " released, staying registered: torch.nn.Module's own buffer table",
    ("worker_node/models/quant_fp8.py", "torch._scaled_mm"): "torch's fp8 GEMM has no public spelling",
    ("worker_node/models/quant_int8.py", "torch.ops.aten._weight_int8pack_mm"): "torch's int8 CPU kernel: the same",
    ("worker_node/models/quantize.py", "module._apply"): "casts one module's own tensors without its children"
    " (recurse=False), what .to() does for all of them; no public method does it for one",
    (
        "worker_node/runtime/parallel.py",
        "gloo._Options",
    ): "a process group's timeout and devices are set only through these"
    " options, as torch.distributed's own init_process_group does",
    ("worker_node/runtime/parallel.py", "options._timeout"): "the same options (gloo's and NCCL's)",
    ("worker_node/runtime/parallel.py", "options._devices"): "the same options object",
}


def private_reaches(source: str) -> list[tuple[int, str]]:
    """Each `x._name` in the source whose `x` is not `self` or `cls` (dunders are public): its line and text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_code_reaches_another_objects_private_names() -> None:
    reached = set()
    unexplained = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            for line, text in private_reaches(path.read_text()):
                reached.add((name, text))
                if (name, text) not in ALLOWED:
                    unexplained.append(f"{name}:{line}: {text}")
    assert unexplained == [], "expose it under a public name, or hand the collaborator what it needs"
    assert sorted(set(ALLOWED) - reached) == [], "no longer reached: unlist it"


def test_the_scan_finds_a_private_name_reached_through_another_object() -> None:
    source = """
class Loop:
    def step(self, other: Other) -> None:
        self._mine = other._theirs          # another object's: flagged
        other.plans._inflight.clear()       # flagged, however deep
        cls_like = type(self)._registry     # not self itself: flagged
        self.__dict__, other.__class__      # dunders are public
        self._helper()                      # its own: fine
"""
    assert private_reaches(source) == [(4, "other._theirs"), (5, "other.plans._inflight"), (6, "type(self)._registry")]


def test_the_allow_list_names_files_that_exist() -> None:
    assert all((REPO / name).is_file() for name, _ in ALLOWED)
