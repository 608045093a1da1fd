"""Host data onto the device without waiting for the device.

torch's ordinary host-to-device copy (`.to(device)`, `torch.tensor(..., device=...)`) synchronizes the CUDA stream
after it: every small upload of a step's inputs, row indices or per-row parameters would make the host wait until
the device has run everything queued before it, and the host could never get ahead of the device (what overlapped
steps need, worker_node/step_overlap.py). A non-blocking copy from pageable memory is staged by the driver before
the call returns (the source may go at once) and is ordered on the stream with the work around it, so nothing
waits. On a CPU both are the same tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    data: np.ndarray | Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`data` (a numpy array, or a list of numbers) as a tensor on `device`, in `dtype` when given."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device, non_blocking=True)
