"""minivllm's public Python API: offline inference in the shape vLLM users know.

from minivllm import LLM, SamplingParams

with LLM() as llm:  # the default model, SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)

The asyncio engine, as vLLM's: `AsyncLLMEngine.from_engine_args(AsyncEngineArgs(max_batch_size=32))`, then
`async for output in engine.generate(prompt, SamplingParams(...), request_id)`; `MemoryMonitor(engine).get_stats()`
and `LMCache(capacity="20GB", policy="arc", offload_to="disk")` as `cache=` (docs/guide.md).
"""

from minivllm.async_engine import AsyncLLMEngine
from minivllm.engine_args import AsyncEngineArgs
from minivllm.llm import LLM
from minivllm.lm_cache import LMCache
from minivllm.lora_request import LoRARequest
from minivllm.memory_monitor import MemoryMonitor
from minivllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from minivllm.prompts import TextPrompt, TokensPrompt
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.scheduling import PriorityScheduler, Scheduler

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "LMCache",
    "MemoryMonitor",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "TextPrompt",
    "TokensPrompt",
    "PriorityScheduler",
    "Scheduler",
]
