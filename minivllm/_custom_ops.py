"""vLLM's `vllm._custom_ops`, for the design article's custom-kernel lines:

    from minivllm import _custom_ops
    _custom_ops.register_kernel("my_attention", "path/to/custom_attention.so")

The library implements kernels/csrc/custom_attention_abi.h (example: deploy/custom_attention_kernel.c); the name
is then an attention backend: `LLM(..., attention_backend="my_attention")`, or the model config's
`{"attention": {"type": "my_attention", "params": {...}}}` as `LLM(..., attention={...})`.
"""

from kernels.custom_kernels import register_kernel, registered_kernels

__all__ = ["register_kernel", "registered_kernels"]
