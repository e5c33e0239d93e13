"""Streamed tool calls put back together. OpenAI streams each call as `delta.tool_calls` pieces keyed
by `index`: the first piece of a call carries its `id`, `type` and `function.name`, later pieces
only more of `function.arguments` (a JSON string cut anywhere, even inside a token or escape)."""

from __future__ import annotations

import json
from typing import Any


class ToolCallAssembler:
    """Collects the `delta.tool_calls` of one choice's chunks, in any number of pieces."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}  # index -> call being assembled

    def add(self, deltas: list[dict[str, Any]]) -> None:
        for position, delta in enumerate(deltas):
            index = delta.get("index", position)
            call = self._calls.setdefault(index, {"id": "", "type": "function", "name": "",
                                                  "arguments": []})
            # NOTE: id and name are whole where they appear (OpenAI sends them once); a server
            # that repeats them on every piece must not have them doubled
            if delta.get("id"):
                call["id"] = delta["id"]
            if delta.get("type"):
                call["type"] = delta["type"]
            function = delta.get("function") or {}
            if function.get("name"):
                call["name"] = function["name"]
            if function.get("arguments"):
                call["arguments"].append(function["arguments"])

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls in index order, shaped as an assistant message's `tool_calls`."""
        return [{"id": call["id"], "type": call["type"],
                 "function": {"name": call["name"], "arguments": "".join(call["arguments"])}}
                for _, call in sorted(self._calls.items())]


def parse_arguments(call: dict[str, Any]) -> dict[str, Any] | None:
    """A call's arguments as a dict; None when they are not a JSON object (a model's mistake)."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except (ValueError, KeyError, TypeError):
        return None
    return arguments if isinstance(arguments, dict) else None
