"""Kernel tests run the Triton kernels in Triton's interpreter on CPU.

TRITON_INTERPRET must be set before any `@triton.jit` decorator runs, i.e. before the kernel modules import.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
