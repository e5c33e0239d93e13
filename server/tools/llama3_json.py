"""Llama 3.1's JSON convention: the whole answer is one call {"name": ..., "parameters": {...}}
(after the <|python_tag|> special token, which detokenizing may drop), several joined by "; "."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from server.tools.parsed_calls import (
    ParsedCall,
    ParsedOutput,
    Scans,
    call_header,
    parse_call,
    streamed_call,
)
from server.tools.parser import ToolCallParser, call_json, tools_json_lines
from server.tools.tool_request import FunctionSpec

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*")


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    arguments_key = "parameters"
    _header = call_header("(?:parameters|arguments)")

    def parse(self, text: str, *, final: bool, forced: bool, tool_names: frozenset[str],
              scans: Scans | None = None) -> ParsedOutput:
        start = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_TAG, start):
            start += len(PYTHON_TAG)
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return ParsedOutput("")  # nothing yet, or the tag's first characters
        if forced:
            return ParsedOutput("", self._streamed(text, start, scans))
        body = text[start:]
        if not final and not body.strip():
            return ParsedOutput("")  # the tag alone so far
        if not body.lstrip().startswith("{"):
            return ParsedOutput(text)
        if not final:
            return ParsedOutput("")  # calls or a JSON answer: decided when the text is whole
        calls = self._whole(body)
        if calls is None or any(call.name not in tool_names for call in calls):
            return ParsedOutput(text)
        return ParsedOutput("", calls)

    def _streamed(self, text: str, position: int, scans: Scans | None) -> tuple[ParsedCall, ...]:
        calls: list[ParsedCall] = []
        while True:
            call, end = streamed_call(text, position, self._header, scans)
            if call is None:
                break
            calls.append(call)
            separator = _SEPARATOR.match(text, end) if end is not None else None
            if separator is None:
                break
            position = separator.end()
        return tuple(calls)

    def _whole(self, text: str) -> tuple[ParsedCall, ...] | None:
        """Every call in a whole answer, or None unless the answer is calls and nothing else."""
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        position = len(text) - len(text.lstrip())
        while True:
            try:
                _, end = decoder.raw_decode(text, position)
            except ValueError:
                return None
            call = parse_call(text[position:end], (self.arguments_key, "arguments"))
            if call is None:
                return None
            calls.append(call)
            if not text[end:].strip():
                return tuple(calls)
            separator = _SEPARATOR.match(text, end)
            if separator is None:
                return None
            position = separator.end()

    def forced_grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> str:
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, self.call_rules(functions)])

    def tools_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        return ("You may call functions to help with the user's request. These are the functions, "
                f"described in JSON Schema:\n{tools_json_lines(functions)}\n\n"
                "To call a function, answer with nothing but a JSON object of the form "
                '{"name": <function name>, "parameters": <arguments as a JSON object>}; '
                'separate several calls with "; ".')

    def write_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(call_json(name, arguments, self.arguments_key)
                         for name, arguments in calls)

    def write_results(self, results: Sequence[str]) -> str:
        return "\n".join(results)
