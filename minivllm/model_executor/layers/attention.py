"""vLLM's `PagedAttention`, for the design article's compatibility check:

    from minivllm.model_executor.layers.attention import PagedAttention
    print(PagedAttention.supports(model_config))

The check itself is worker_node/models/attention_support.py's.
"""

from __future__ import annotations

from worker_node.models.attention_support import Support, attention_support

__all__ = ["PagedAttention", "Support"]


class PagedAttention:
    """The workers' paged attention (cache `[num_blocks, block_size, num_kv_heads, head_dim]`, the backends of
    kernels/backend.py), as far as a user asks about it before deploying a model."""

    @staticmethod
    def supports(model_config: object) -> Support:
        """Whether it runs `model_config`'s model (a config.json dict, optionally with an `attention` section
        naming the backend; an HF config; a ModelConfig; a model folder): a `Support`, truthy when it does, whose
        text says what was checked or every reason it does not."""
        return attention_support(model_config)
