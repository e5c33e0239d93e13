"""The Hermes convention (Qwen2.5, Hermes 2 Pro and many fine-tunes): each call a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; results come back between
<tool_response> and </tool_response>."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.tools.parsed_calls import (
    ParsedCall,
    ParsedOutput,
    Scans,
    call_header,
    parse_call,
    streamed_call,
    withheld_tail,
)
from server.tools.parser import ToolCallParser, call_json, tools_json_lines
from server.tools.tool_request import FunctionSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"
    arguments_key = "arguments"
    _header = call_header("arguments")

    def parse(self, text: str, *, final: bool, forced: bool, tool_names: frozenset[str],
              scans: Scans | None = None) -> ParsedOutput:
        return self._forced(text, scans) if forced else self._auto(text, final, tool_names)

    def _forced(self, text: str, scans: Scans | None) -> ParsedOutput:
        calls: list[ParsedCall] = []
        position = 0
        while (start := text.find(OPEN, position)) >= 0:
            call, end = streamed_call(text, start + len(OPEN), self._header, scans)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            position = end
        return ParsedOutput("", tuple(calls))

    def _auto(self, text: str, final: bool, tool_names: frozenset[str]) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        position = 0
        while True:
            start = text.find(OPEN, position)
            if start < 0:
                tail = text[position:]
                content.append(tail if final else tail[:len(tail) - withheld_tail(tail, OPEN)])
                break
            content.append(text[position:start])
            close = text.find(CLOSE, start + len(OPEN))
            if close < 0 and not final:
                break  # an open block: a call or content, decided when it closes
            end = len(text) if close < 0 else close + len(CLOSE)
            call = parse_call(text[start + len(OPEN):close if close >= 0 else end],
                              (self.arguments_key, "parameters"))
            if call is not None and call.name in tool_names:
                calls.append(call)
            else:  # not a call this request allows: the model's text, as it wrote it
                content.append(text[start:end])
            position = end
        return ParsedOutput("".join(content), tuple(calls))

    def forced_grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> str:
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        return "\n".join([start, f'block: "{OPEN}\\n" call "\\n{CLOSE}"',
                          self.call_rules(functions)])

    def tools_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        return ("You may call one or more functions to help with the user's request. The functions "
                "are described in JSON Schema within <tools></tools>:\n<tools>\n"
                f"{tools_json_lines(functions)}\n</tools>\n\n"
                "To call a function, answer with a JSON object of its name and arguments within "
                f"{OPEN}{CLOSE} tags, one block per call:\n"
                f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
                f"\n{CLOSE}")

    def write_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(f"{OPEN}\n{call_json(name, arguments, self.arguments_key)}\n{CLOSE}"
                         for name, arguments in calls)

    def write_results(self, results: Sequence[str]) -> str:
        return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)
