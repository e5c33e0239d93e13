"""What a tool-call convention provides: how calls are parsed from the model's text, the grammar that
forces calls when tool_choice demands one, and, for a chat template that knows no tools, how tools,
earlier calls and their results are written into the conversation."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from engine.structured.compiler import JSON_OPTIONS
from server.tools.parsed_calls import ParsedOutput, Scans
from server.tools.tool_request import FunctionSpec


class ToolCallParser(ABC):
    name: str
    # the key the convention writes a call's arguments under (also accepted: "arguments")
    arguments_key: str

    @abstractmethod
    def parse(self, text: str, *, final: bool, forced: bool, tool_names: frozenset[str],
              scans: Scans | None = None) -> ParsedOutput:
        """The calls and content in `text`, prefix-stable (parsed_calls.py); `final` once the text
        is whole. `forced`: a grammar made the text calls only (streamed as they are written);
        otherwise calls count once whole, valid JSON and of a function in `tool_names`, and the
        rest is content. `scans`: a stream's reads of the text so far, resumed, not repeated."""

    @abstractmethod
    def forced_grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call to one of `functions`, or
        several when `parallel`, with arguments that validate against the function's schema."""

    @abstractmethod
    def tools_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        """A system-message text that describes the tools and this convention, for a chat template
        that knows no tools."""

    @abstractmethod
    def write_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Earlier calls (name, arguments) as the model would have written them."""

    @abstractmethod
    def write_results(self, results: Sequence[str]) -> str:
        """Tool results, as the user turn that hands them back to the model."""

    def call_json_schema(self, function: FunctionSpec) -> dict[str, Any]:
        """One call to `function` as a JSON object, name first, so streams see the name early."""
        return {
            "type": "object",
            "properties": {"name": {"const": function.name},
                           self.arguments_key: function.parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
            # NOTE: at the root of each %json, where it wins over a client's "x-guidance"
            "x-guidance": JSON_OPTIONS,
        }

    def call_rules(self, functions: Sequence[FunctionSpec]) -> str:
        """Lark rules: `call` is one call to any of `functions`."""
        names = [f"call_{index}" for index in range(len(functions))]
        rules = [f"call: {' | '.join(names)}"]
        rules += [f"{name}: %json {json.dumps(self.call_json_schema(function))}"
                  for name, function in zip(names, functions)]
        return "\n".join(rules)


def call_json(name: str, arguments: Any, arguments_key: str) -> str:
    """A call as JSON text; arguments given as a JSON string are written as the object they hold."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return json.dumps({"name": name, arguments_key: arguments}, ensure_ascii=False)


def tools_json_lines(functions: Sequence[FunctionSpec]) -> str:
    return "\n".join(json.dumps(f.as_openai_tool(), ensure_ascii=False) for f in functions)
