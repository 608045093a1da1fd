"""vLLM's `vllm.model_executor.layers` paths that the design article uses."""
