"""minivllm's public Python API: offline inference in the shape vLLM users know.

from minivllm import LLM, SamplingParams

with LLM() as llm:  # the default model, SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)
"""

from minivllm.llm import LLM, TextPrompt, TokensPrompt
from minivllm.lora_request import LoRARequest
from minivllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.scheduling import PriorityScheduler, Scheduler

__all__ = [
    "LLM",
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
