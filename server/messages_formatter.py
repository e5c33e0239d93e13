"""Anthropic's Message, and the events of its stream, from a Generation: the text becomes a text
block, each tool call a tool_use block, the finish reason a stop_reason.

A stream sends the blocks as the text grows (content_block_start, deltas, content_block_stop) between
message_start and message_delta + message_stop, so that the SDK's accumulated message equals the
non-streamed one. Prompt tokens the prefix cache held count as cache_read_input_tokens, as
Anthropic's do, and input_tokens the rest.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from server.api_responses import ResponseMetrics
from server.generation import Generation
from server.response_formatter import ResponseFormatter
from server.tools.call_reader import ToolCallReader, ToolCallStream

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class _WithMetrics(BaseModel):
    """Dumps `metrics` (specserve's extra, declared last by each subclass) only when it is set;
    every other field always."""

    # NOTE: no return annotation on purpose: pydantic would take it as the JSON schema of the model
    @model_serializer(mode="wrap")
    def _omit_unset_metrics(self, serialize: SerializerFunctionWrapHandler):
        data = serialize(self)
        if data.get("metrics", 0) is None:
            del data["metrics"]
        return data


# ---------------------------------------------------------------------- the message
class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextContent | ToolUseContent


class MessageUsage(BaseModel):
    # prompt tokens the prefix cache did not hold
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(_WithMetrics):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    # null only in a stream's message_start
    stop_reason: StopReason | None = None
    # the stop sequence that ended the message, if one did
    stop_sequence: str | None = None
    usage: MessageUsage
    metrics: ResponseMetrics | None = None


class TokenCount(BaseModel):
    """POST /v1/messages/count_tokens."""

    input_tokens: int


# ---------------------------------------------------------------------- stream events
class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    # empty: a text block's text "", a tool_use block's input {}
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    # the next piece of the tool input's JSON text
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(_WithMetrics):
    """The message's end: its stop reason and final usage (which the SDK puts over
    message_start's), with the speculation metrics extra."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageUsage
    metrics: ResponseMetrics | None = None


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent
               | ContentBlockStopEvent | MessageDeltaEvent | MessageStopEvent)


# ---------------------------------------------------------------------- the formatter
class MessagesFormatter:
    """One request's Message, or its stream's events, in order: `opening_events`, then
    `piece_events` for each piece, then `closing_events`."""

    def __init__(self, model_name: str, tool_calls: ToolCallReader | None) -> None:
        """`tool_calls`: how to read calls out of the text; None when the request may make none."""
        self.model_name = model_name
        self.tool_calls = tool_calls
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        # the stream's state
        self._calls = None if tool_calls is None else ToolCallStream(tool_calls)
        self._num_blocks = 0
        self._open_block: Literal["text", "tool_use"] | None = None
        # tool call index -> its block's index
        self._call_blocks: dict[int, int] = {}
        self._finish_reason: str | None = None

    def message(self, generation: Generation) -> Message:
        tracker = generation.choices[0].tracker
        text, finish_reason = tracker.text, tracker.finish_reason
        content: list[ContentBlock] = []
        if self.tool_calls is None:
            content += [TextContent(text=text)] if text else []
        else:
            text, calls, finish_reason = self.tool_calls.message(text, finish_reason)
            content += [TextContent(text=text)] if text else []
            content += [ToolUseContent(id=tool_use_id(), name=call.function.name,
                                       input=_tool_input(call.function.arguments))
                        for call in calls or ()]
        stop_reason, stop_sequence = _stop(finish_reason, tracker.stop_reason)
        return Message(id=self.message_id, model=self.model_name, content=content,
                       stop_reason=stop_reason, stop_sequence=stop_sequence,
                       usage=_usage(generation), metrics=ResponseFormatter.metrics(generation))

    # ------------------------------------------------------------------ streaming
    def opening_events(self, generation: Generation) -> list[StreamEvent]:
        """message_start; the prefix cache's share of the prompt is known only at the end."""
        usage = MessageUsage(input_tokens=generation.num_prompt_tokens, output_tokens=0)
        return [MessageStartEvent(message=Message(id=self.message_id, model=self.model_name,
                                                  content=[], usage=usage))]

    def piece_events(self, text: str, finish_reason: str | None) -> list[StreamEvent]:
        """The blocks begun and added to by the next piece of text; the last one closed when
        `finish_reason` ends the message."""
        events: list[StreamEvent] = []
        call_deltas = []
        if self._calls is not None:
            text, call_deltas, finish_reason = self._calls.feed(text, finish_reason)
        if text:
            if self._open_block != "text":
                events += self._start_block(TextContent(text=""))
            events.append(ContentBlockDeltaEvent(index=self._num_blocks - 1,
                                                 delta=TextDelta(text=text)))
        for delta in call_deltas:
            if delta.id is not None:  # a call's first delta: its name
                events += self._start_block(ToolUseContent(id=tool_use_id(),
                                                           name=delta.function.name, input={}))
                self._call_blocks[delta.index] = self._num_blocks - 1
            if delta.function.arguments:
                events.append(ContentBlockDeltaEvent(
                    index=self._call_blocks[delta.index],
                    delta=InputJsonDelta(partial_json=delta.function.arguments)))
        if finish_reason is not None:
            self._finish_reason = finish_reason
            events += self._stop_block()
        return events

    def closing_events(self, generation: Generation) -> list[StreamEvent]:
        tracker = generation.choices[0].tracker
        stop_reason, stop_sequence = _stop(self._finish_reason or tracker.finish_reason,
                                           tracker.stop_reason)
        return [*self._stop_block(),
                MessageDeltaEvent(delta=MessageDelta(stop_reason=stop_reason,
                                                     stop_sequence=stop_sequence),
                                  usage=_usage(generation),
                                  metrics=ResponseFormatter.metrics(generation)),
                MessageStopEvent()]

    def _start_block(self, block: ContentBlock) -> list[StreamEvent]:
        events = self._stop_block()
        events.append(ContentBlockStartEvent(index=self._num_blocks, content_block=block))
        self._num_blocks += 1
        self._open_block = block.type
        return events

    def _stop_block(self) -> list[StreamEvent]:
        if self._open_block is None:
            return []
        self._open_block = None
        return [ContentBlockStopEvent(index=self._num_blocks - 1)]


def _stop(finish_reason: str | None, matched: int | str | None
          ) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) for chat's finish reason (after tool calls are read) and the
    tracker's stop_reason (a stop string, a stop token id, or None for EOS)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(generation: Generation) -> MessageUsage:
    num_cached = generation.num_cached_tokens
    return MessageUsage(input_tokens=generation.num_prompt_tokens - num_cached,
                        output_tokens=generation.num_completion_tokens,
                        cache_read_input_tokens=num_cached)


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object they hold; {} for a call cut short by max_tokens."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
