"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked and put in one shape.

Every error names the field at fault (`tools[1].function.name`), as a 400 from the request's
validation. Whether a schema can be enforced is checked later, only where a grammar must enforce it
(server/tools/forced_calls.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.structured.response_format import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, nesting_depth
from server.tools.parsed_calls import FUNCTION_NAME

# OpenAI allows 128 tools a request
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
# all of a request's parameter schemas together, in bytes of JSON: what the grammar check may
# compile for one request (~1 s per 100 kB), and what the prompt shows the model
MAX_TOOLS_SCHEMA_BYTES = 256_000
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
# a function declared without parameters takes none: its arguments are always {}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str | None
    # a JSON schema of type object (type added when the client left it out)
    parameters: dict[str, Any]

    def as_openai_tool(self) -> dict[str, Any]:
        """The tool as chat templates and prompts show it to the model."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    # the function a named choice demands
    function_name: str | None = None


def parse_tools(value: Any) -> tuple[FunctionSpec, ...] | None:
    """`tools`: None or [] means no tools."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("must be a list of {\"type\": \"function\", \"function\": {...}}")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"has {len(value)} tools; at most {MAX_TOOLS}")
    specs = tuple(_parse_tool(tool, f"tools[{index}]") for index, tool in enumerate(value))
    size = sum(len(json.dumps(spec.parameters).encode()) for spec in specs)
    if size > MAX_TOOLS_SCHEMA_BYTES:
        raise ValueError(f"the tools' parameters hold {size} bytes of JSON schema together; at "
                         f"most {MAX_TOOLS_SCHEMA_BYTES}")
    names = [spec.name for spec in specs]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ValueError(f"names the function {duplicate!r} twice; function names must be unique")
    return specs or None


def parse_tool_choice(value: Any, tools: tuple[FunctionSpec, ...] | None) -> ToolChoice:
    """`tool_choice`; its default is "auto" with tools and "none" without, as OpenAI's."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ValueError(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ...}}}}, got {value!r}")
        if value != "none" and not tools:
            raise ValueError(f"{value!r} needs tools; this request has none")
        return ToolChoice(value)
    if not isinstance(value, Mapping) or value.get("type") != "function" \
            or not isinstance(value.get("function"), Mapping):
        raise ValueError("a named choice must be {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}")
    name = value["function"].get("name")
    known = [spec.name for spec in tools or ()]
    if name not in known:
        raise ValueError(f"names the function {name!r}, which is not in tools"
                         + (f" ({', '.join(known)})" if known else " (this request has none)"))
    return ToolChoice("named", name)


def _parse_tool(tool: Any, where: str) -> FunctionSpec:
    if not isinstance(tool, Mapping):
        raise ValueError(f"{where} must be an object")
    _reject_unknown(tool, _TOOL_KEYS, where)
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function is required: an object with a name")
    _reject_unknown(function, _FUNCTION_KEYS, f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise ValueError(f"{where}.function.name is required: 1 to 64 characters of a-z, A-Z, "
                         f"0-9, _ or -")
    description = function.get("description")
    if description is not None and (not isinstance(description, str)
                                    or len(description) > MAX_DESCRIPTION_CHARS):
        raise ValueError(f"{where}.function.description must be a string of at most "
                         f"{MAX_DESCRIPTION_CHARS} characters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be a boolean")
    return FunctionSpec(name, description,
                        _parameters(function.get("parameters"), f"{where}.function.parameters"))


def _parameters(schema: Any, where: str) -> dict[str, Any]:
    if schema is None:
        return dict(NO_PARAMETERS)
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where} must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be 'object': arguments are a JSON object")
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where} is nested too deeply (at most {MAX_SCHEMA_DEPTH} levels)")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} is not valid JSON: {error}") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{where} is too large (at most {MAX_SCHEMA_BYTES} bytes of JSON)")
    return {"type": "object", **json.loads(text)}


def _reject_unknown(value: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(sorted(allowed))}")
