"""The HTTP door's flags (vllm-scheduler, vllm-serve): where it listens, the model name it answers to, its key."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from scheduler_node.api.openai_server import OpenAIConfig

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
        help="the model name /v1/models lists and requests' `model` must match (default: the model folder's name)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"HTTP API requests need 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; empty: open; /health "
        "and /metrics stay open)",
    )


def openai_config(args: argparse.Namespace, folder: Path) -> OpenAIConfig | None:
    """The door's settings, or None when --openai-port is 0; ValueError naming a flag out of range."""
    if not 0 <= args.openai_port < 65536:
        raise ValueError(f"--openai-port must be in [0, 65535], got {args.openai_port}")
    if not args.openai_port:
        return None
    return OpenAIConfig(args.host, args.openai_port, args.served_model_name or folder.name, args.api_key)
