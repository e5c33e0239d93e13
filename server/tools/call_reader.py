"""A choice's text read as a chat message: content and tool calls, whole for a response, or as the
differences a stream sends after each piece, so a stream's pieces add up to the response's message.

Content is stripped of the whitespace around it: a stream holds trailing whitespace back until more
text follows it, which keeps what it sent a prefix of the final content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.api_responses import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from server.tools.parsed_calls import ParsedCall, Scans
from server.tools.parser import ToolCallParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallReader:
    """How one request's choices are read."""

    parser: ToolCallParser
    # a grammar made the output calls only (tool_choice "required" or a named function)
    forced: bool
    tool_names: frozenset[str]

    def calls_and_content(self, text: str, *, final: bool, scans: Scans | None = None
                          ) -> tuple[str, tuple[ParsedCall, ...]]:
        parsed = self.parser.parse(text, final=final, forced=self.forced,
                                   tool_names=self.tool_names, scans=scans)
        # NOTE: stripped at the end too while streaming: trailing whitespace is sent only once
        # text follows it, and never if none does
        return parsed.content.strip(), parsed.calls

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool_calls, finish_reason) of a whole choice."""
        content, calls = self.calls_and_content(text, final=True)
        tool_calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name,
                                                                   arguments=c.arguments))
                      for c in calls]
        return content or None, tool_calls or None, _finish_reason(finish_reason, bool(calls))


@dataclass
class ToolCallStream:
    """One streamed choice: feed it each piece's text, send what it returns."""

    reader: ToolCallReader
    text: str = ""
    sent_content: str = ""
    # per call sent so far: its id and how much of its arguments
    sent_calls: list[tuple[str, int]] = field(default_factory=list)
    # how far each JSON value of the text has been read (parsed_calls.ValueScan)
    scans: Scans = field(default_factory=dict)

    def feed(self, text: str, finish_reason: str | None
             ) -> tuple[str, list[ToolCallDelta], str | None]:
        """(new content, tool-call deltas, finish reason) after `text`; the choice ends when
        finish_reason is not None."""
        self.text += text
        final = finish_reason is not None
        content, calls = self.reader.calls_and_content(self.text, final=final, scans=self.scans)
        new_content = content[len(self.sent_content):]
        self.sent_content = content
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(calls):
            if index == len(self.sent_calls):
                self.sent_calls.append((call_id(), 0))
                deltas.append(ToolCallDelta(index=index, id=self.sent_calls[index][0],
                                            type="function",
                                            function=FunctionCallDelta(name=call.name,
                                                                       arguments="")))
            identifier, num_sent = self.sent_calls[index]
            if len(call.arguments) > num_sent:
                deltas.append(ToolCallDelta(index=index, function=FunctionCallDelta(
                    arguments=call.arguments[num_sent:])))
                self.sent_calls[index] = (identifier, len(call.arguments))
        return new_content, deltas, _finish_reason(finish_reason, bool(self.sent_calls))


def _finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason
