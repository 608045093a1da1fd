"""Tools for a chat template that has none (SmolLM2's, for one): the conversation rewritten in the Hermes style
that Qwen's templates use, so the default `--tool-call-parser hermes` reads the calls back.

- the tools go into the system message (one is added when the conversation has none): their JSON schemas inside
  `<tools></tools>`, and how to call them: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`;
- an assistant message's earlier calls become `<tool_call>` blocks in its content;
- a `tool` message becomes a user message holding `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

DEFAULT_SYSTEM = "You are a helpful assistant."


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with the tools and every tool call or result written as text a template without tools renders."""
    out = [_plain(m) for m in messages]
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{prompt}"})
    return out


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    ]
    content = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
