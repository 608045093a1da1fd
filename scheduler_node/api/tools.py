"""A chat request's tools and tool_choice, worked out once: what the chat template is given, what constrains the
output, and which parser reads the calls out of it.

- `none` (the default without tools): the tools are still shown to the model (as vLLM does); the output is content.
- `auto` (the default with tools): the output is read by `--tool-call-parser`; what is not a call is content.
- `required`: the output is constrained to a JSON array of one or more `{"name", "parameters"}` objects, one per
  call, each valid for its function's schema (one call with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from scheduler_node.api.sampling import StructuredFields
from scheduler_node.api.tool_parsers import JsonArrayToolParser, NamedToolParser, ToolParser
from scheduler_node.api.tool_stream import ToolCallStream
from scheduler_node.api.validation import InvalidField


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the rest of the request body (openai_protocol.py)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None  # accepted; required and named calls are always enforced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # fullmatch: `$` would pass a final newline
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    functions: dict[str, dict[str, Any]]  # name -> the function's definition as the template reads it
    name: str = ""  # the named function
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the form chat templates read (HF's): [{"type": "function", "function": {...}}]."""
        return [{"type": "function", "function": f} for f in self.functions.values()] or None

    def parameters(self, name: str) -> dict[str, Any]:
        return self.functions[name].get("parameters") or NO_ARGUMENTS

    def structured(self) -> StructuredFields | None:
        """The constraint that makes a required or named choice's output valid calls (None for none / auto)."""
        if self.mode == "named":
            return StructuredFields(json=self.parameters(self.name))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": self.parameters(name)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in self.functions
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredFields(json=array)

    def calls(self, auto: type[ToolParser]) -> ToolCallStream | None:
        """How one choice's output is read (None: it is all content)."""
        parser: ToolParser
        if self.mode == "named":
            parser = NamedToolParser(self.name)
        elif self.mode == "required":
            parser = JsonArrayToolParser()
        elif self.mode == "auto":
            parser = auto()
        else:
            return None
        return ToolCallStream(parser, self.parallel)


def tool_plan(tools: Sequence[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool) -> ToolPlan:
    """The plan for a request's tools; InvalidField naming the field that is wrong."""
    functions = _functions(tools or [])
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, str):
        if choice != "none" and not functions:
            raise InvalidField("tool_choice", f"{choice!r} needs tools")
        return ToolPlan(choice, functions, parallel=parallel)
    name = choice.function.name
    if name not in functions:
        known = ", ".join(functions) or "none"
        raise InvalidField("tool_choice.function.name", f"no tool named {name!r} (tools: {known})")
    return ToolPlan("named", functions, name, parallel=False)


def _functions(tools: Sequence[Tool]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise InvalidField("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.function
        if not _NAME.fullmatch(function.name):
            raise InvalidField(f"tools[{i}].function.name", "must be 1 to 64 letters, digits, _ . : or -")
        if function.name in functions:
            raise InvalidField(f"tools[{i}].function.name", f"{function.name!r} is given twice")
        if function.parameters is not None and function.parameters.get("type", "object") != "object":
            raise InvalidField(f"tools[{i}].function.parameters", 'must be a JSON schema of "type": "object"')
        functions[function.name] = function.model_dump(exclude_none=True)
    return functions


def check_schemas(plan: ToolPlan, error_of: Any) -> None:
    """Each function a required or named choice enforces compiles (`error_of(schema text)`: why not, or "")."""
    if plan.structured() is None:
        return
    names = [plan.name] if plan.mode == "named" else list(plan.functions)
    positions = {name: i for i, name in enumerate(plan.functions)}
    for name in names:
        error = error_of(json.dumps(plan.parameters(name)))
        if error:
            raise InvalidField(f"tools[{positions[name]}].function.parameters", f"cannot be enforced: {error}")
