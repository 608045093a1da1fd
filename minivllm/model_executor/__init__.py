"""vLLM's `vllm.model_executor` paths that the design article uses, over minivllm's workers."""
