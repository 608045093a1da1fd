"""The decode-layers runner's library and its C structs (the model-level check against the Python layers is
tests/worker_node/models/test_native_decode.py)."""

import ctypes

import pytest

from kernels import cpu_decode_layers

pytestmark = pytest.mark.unit


def test_it_builds_and_a_step_of_no_layers_does_nothing() -> None:
    library = cpu_decode_layers.load()
    assert library is not None, "the C runner must build on the test machines (gcc is in the set-up)"
    step = cpu_decode_layers.Step(rows=1)
    layers = (cpu_decode_layers.Layer * 0)()
    assert library.run_decode_layers(ctypes.byref(cpu_decode_layers.Kernels()), layers, 0, ctypes.byref(step)) == 0


def test_the_structs_have_the_c_layout() -> None:
    """Eight 8-byte fields per Gemm; Step's profile pointer last, after the int threads (padded to 8)."""
    assert ctypes.sizeof(cpu_decode_layers.Gemm) == 64
    assert ctypes.sizeof(cpu_decode_layers.Layer) == 2 * 8 + 4 * 64 + 2 * 8
    assert cpu_decode_layers.Step.phase_seconds.offset == ctypes.sizeof(cpu_decode_layers.Step) - 8
    assert len(cpu_decode_layers.PHASES) == 8
