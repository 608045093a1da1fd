"""Host data onto the device (worker_node/runtime/host_copy.py): the values and dtype asked for, from numpy arrays and
lists alike. That the copy does not wait for the device is CUDA's to show (scripts/gpu_decode.py's A/B)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_node.runtime.host_copy import to_device

pytestmark = pytest.mark.unit


def test_arrays_and_lists_arrive_as_asked() -> None:
    cpu = torch.device("cpu")
    array = np.array([3, -1, 7], dtype=np.int32)
    t = to_device(array, cpu)
    assert t.dtype == torch.int32 and t.tolist() == [3, -1, 7]
    assert to_device(array, cpu, torch.int64).dtype == torch.int64
    assert to_device([1, 2], cpu, torch.int64).tolist() == [1, 2]
    floats = to_device([0.5, 0.25], cpu, torch.float64)
    assert floats.dtype == torch.float64 and floats.tolist() == [0.5, 0.25]
    assert to_device([1.5], cpu, torch.bfloat16).dtype == torch.bfloat16
    assert to_device([], cpu, torch.int64).shape == (0,)
