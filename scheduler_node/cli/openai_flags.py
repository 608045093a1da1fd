"""The HTTP door's flags (vllm-scheduler, vllm-serve): where it listens, the model name it answers to, its key."""

from __future__ import annotations

import argparse
import os

from scheduler_node.api.embeddings import POOLINGS
from scheduler_node.api.openai_server import OpenAIConfig
from scheduler_node.api.reasoning_parsers import REASONING_PARSERS, reasoning_parser_class
from scheduler_node.api.tool_parsers import TOOL_PARSERS, tool_parser_class

API_KEY_ENV = "MINIVLLM_API_KEY"
SERVE_OPENAI_PORT = 8000  # vllm-serve's default (vllm-scheduler's is 0: off)


def add_openai_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--openai-port",
        type=int,
        default=0,
        help=f"port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...) on --host "
        f"(0: off; vllm-serve's default is {SERVE_OPENAI_PORT})",
    )
    p.add_argument(
        "--served-model-name",
        default="",
        help="the model name requests give in `model` (gRPC: another name is NOT_FOUND; HTTP: 404), /v1/models lists "
        "and the metrics' model_name label (default: a hub id as given, else the model folder's name)",
    )
    add_api_key_flag(p)
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        help=f"how tool_choice auto reads tool calls out of the output: {', '.join(TOOL_PARSERS)}, or module:Class "
        "(a subclass of scheduler_node.api.tool_parsers.ToolParser); required and named choices need none",
    )
    p.add_argument(
        "--reasoning-parser",
        default="",
        help=f"split the model's <think>...</think> off into reasoning_content: {', '.join(REASONING_PARSERS)}"
        ", or module:Class (a subclass of scheduler_node.api.reasoning_parsers.ReasoningParser); structured output "
        "and required tool calls then apply to the answer after the reasoning (default: off)",
    )
    p.add_argument(
        "--embedding-pooling",
        choices=POOLINGS,
        default="last",
        help="how POST /v1/embeddings pools a prompt's final hidden states: the last token's (decoder embedding "
        "models: Qwen3-Embedding, e5-mistral) or the mean of all of them; normalized unless normalize: false",
    )


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    """--api-key (vllm-scheduler, vllm-serve, vllm-router)."""
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"HTTP API requests need 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; empty: open; /health "
        "and /metrics stay open)",
    )


def openai_config(args: argparse.Namespace, served_model_name: str) -> OpenAIConfig | None:
    """The door's settings, or None when --openai-port is 0; ValueError naming a flag out of range."""
    if not 0 <= args.openai_port < 65536:
        raise ValueError(f"--openai-port must be in [0, 65535], got {args.openai_port}")
    if not args.openai_port:
        return None
    tool_parser_class(args.tool_call_parser)  # ValueErrors naming them
    reasoning_parser_class(args.reasoning_parser)
    return OpenAIConfig(
        args.host,
        args.openai_port,
        served_model_name,
        api_key=args.api_key,
        control_token=args.control_token,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        embedding_pooling=args.embedding_pooling,
    )
