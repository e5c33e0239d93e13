"""The Responses API's Response object and its streamed events, built from a Generation.

A response's output is an assistant message (its text), then one function_call item per tool call.
A stream opens each item when its first text or call arrives and closes it when the next begins or
the response ends, so its events add up to the response that `response.completed` carries:

    response.created, response.in_progress
    per item:  response.output_item.added
       message:  response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
       call:     response.function_call_arguments.delta..., response.function_call_arguments.done
               response.output_item.done
    response.completed | response.incomplete (a length stop) | response.failed (the engine failed)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from server.api_responses import ResponseMetrics, ToolCallDelta
from server.errors import ApiError
from server.generation import Generation
from server.responses_api import ResponsesRequest
from server.tools.call_reader import ToolCallReader

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def new_id(prefix: str) -> str:
    """OpenAI's Responses ids: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------- the Response object
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    status: ItemStatus = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    # what the client's function_call_output item answers
    call_id: str
    name: str
    # JSON text of the arguments object
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    # prompt tokens whose KV came from the prefix cache
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int

    @classmethod
    def of(cls, generation: Generation) -> ResponseUsage:
        num_input, num_output = generation.num_prompt_tokens, generation.num_completion_tokens
        return cls(input_tokens=num_input, output_tokens=num_output,
                   total_tokens=num_input + num_output,
                   input_tokens_details=InputTokensDetails(
                       cached_tokens=generation.num_cached_tokens))


class IncompleteDetails(BaseModel):
    # None when the server cancelled the request (on shutdown)
    reason: Literal["max_output_tokens"] | None = None


class ResponseErrorInfo(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """OpenAI's Response, with the request's settings echoed and specserve's `metrics` extra."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    background: bool = False
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    # specserve extra: the speculation of this response (DESIGN.md "Request and response extras")
    metrics: ResponseMetrics | None = None

    # NOTE: no return annotation on purpose: pydantic would take it as the JSON schema
    @model_serializer(mode="wrap")
    def _omit_metrics_until_known(self, serialize: SerializerFunctionWrapHandler):
        data = serialize(self)
        if data.get("metrics", 0) is None:
            del data["metrics"]
        return data


class ResponsesFormatter:
    """What every Response of one request shares (id, time, the request's settings echoed), and
    the whole response of a generation that was not streamed."""

    def __init__(self, model_name: str, request: ResponsesRequest) -> None:
        self.model_name = model_name
        self.request = request
        self.response_id = new_id("resp")
        self.created_at = int(time.time())

    def response(self, status: ResponseStatus, output: Sequence[OutputMessage | FunctionCallItem],
                 generation: Generation | None = None,
                 error: ApiError | None = None) -> ResponseObject:
        """`generation`: the finished one, whose usage, metrics and finish reason it reports."""
        request = self.request
        finish_reason = generation.choices[0].tracker.finish_reason if generation else None
        fmt = request.text.format if request.text is not None else None
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, model=self.model_name,
            output=list(output),
            error=None if error is None else ResponseErrorInfo(message=error.message),
            incomplete_details=(IncompleteDetails(reason=_incomplete_reason(finish_reason))
                                if status == "incomplete" else None),
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, store=request.is_stored,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            text={"format": fmt or {"type": "text"}},
            tool_choice=request.tool_choice or ("auto" if request.function_tools else "none"),
            tools=[tool.model_dump() for _, tool in request.function_tools],
            metadata=request.metadata if isinstance(request.metadata, dict) else {},
            usage=None if generation is None else ResponseUsage.of(generation),
            metrics=None if generation is None else ResponseMetrics.of(
                generation.reports(), generation.num_spec_tokens))

    def whole(self, generation: Generation, reader: ToolCallReader | None) -> ResponseObject:
        """The response of a finished generation (one choice), its calls read by `reader`."""
        tracker = generation.choices[0].tracker
        content, calls = tracker.text, []
        if reader is not None:
            content, tool_calls, _ = reader.message(tracker.text, tracker.finish_reason)
            calls = tool_calls or []
        output: list[OutputMessage | FunctionCallItem] = []
        if content or not calls:
            output.append(OutputMessage(content=[OutputText(text=content or "")]))
        output += [FunctionCallItem(call_id=call.id, name=call.function.name,
                                    arguments=call.function.arguments) for call in calls]
        status = final_status(tracker.finish_reason)
        for item in output:
            item.status = "completed"
        output[-1].status = _last_item_status(status)
        return self.response(status, output, generation)


def final_status(finish_reason: str | None) -> ResponseStatus:
    """A length stop (or a cancel) leaves the response incomplete; anything else completes it."""
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


def _incomplete_reason(finish_reason: str | None) -> Literal["max_output_tokens"] | None:
    return "max_output_tokens" if finish_reason == "length" else None


def _last_item_status(status: ResponseStatus) -> ItemStatus:
    return "incomplete" if status == "incomplete" else "completed"


# ---------------------------------------------------------------------- streamed events
class ResponseEvent(BaseModel):
    type: str
    # 0, 1, 2, ... over one stream's events
    sequence_number: int

    def sse(self) -> str:
        return f"event: {self.type}\ndata: {json.dumps(self.model_dump(mode='json'))}\n\n"


class LifecycleEvent(ResponseEvent):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete", "response.failed"]
    response: ResponseObject


class OutputItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = \
        "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = \
        "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseEventStream:
    """One streamed response: feed it the text and call deltas of each piece, send what it
    returns. Events carry copies of the items, so later text never changes one already sent."""

    def __init__(self, formatter: ResponsesFormatter) -> None:
        self.formatter = formatter
        self.output: list[OutputMessage | FunctionCallItem] = []
        self._num_events = 0
        # the last item of `output` while it is still being written
        self._open: OutputMessage | FunctionCallItem | None = None

    def opening(self) -> list[ResponseEvent]:
        response = self.formatter.response("in_progress", [])
        return [self._event(LifecycleEvent, type="response.created", response=response),
                self._event(LifecycleEvent, type="response.in_progress", response=response)]

    def feed(self, content: str, call_deltas: Sequence[ToolCallDelta] = ()) -> list[ResponseEvent]:
        """Events for new message text, then for calls begun (a delta with an id) or continued."""
        events: list[ResponseEvent] = []
        if content:
            if not isinstance(self._open, OutputMessage):
                events += self._close("completed") + self._open_message()
            self._open.content[0].text += content
            events.append(self._event(TextDeltaEvent, item_id=self._open.id,
                                      output_index=len(self.output) - 1, delta=content))
        for delta in call_deltas:
            if delta.id is not None:
                events += self._close("completed")
                events += self._open_item(FunctionCallItem(call_id=delta.id,
                                                           name=delta.function.name or ""))
            if delta.function.arguments and isinstance(self._open, FunctionCallItem):
                self._open.arguments += delta.function.arguments
                events.append(self._event(ArgumentsDeltaEvent, item_id=self._open.id,
                                          output_index=len(self.output) - 1,
                                          delta=delta.function.arguments))
        return events

    def closing(self, generation: Generation) -> tuple[list[ResponseEvent], ResponseObject]:
        """The last events of a finished generation, and the response they complete."""
        status = final_status(generation.choices[0].tracker.finish_reason)
        events = [] if self.output else self._open_message()
        events += self._close(_last_item_status(status))
        response = self.formatter.response(status, self.output, generation)
        event_type = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(LifecycleEvent, type=event_type, response=response)], response

    def failed(self, error: ApiError) -> ResponseEvent:
        """The last event of a stream whose generation failed: the output so far, incomplete."""
        if self._open is not None:
            self._open.status = "incomplete"
        response = self.formatter.response("failed", self.output, error=error)
        return self._event(LifecycleEvent, type="response.failed", response=response)

    # ------------------------------------------------------------------ internals
    def _event(self, event_type: type[ResponseEvent], **fields: Any) -> ResponseEvent:
        event = event_type(sequence_number=self._num_events, **fields)
        self._num_events += 1
        return event

    def _open_message(self) -> list[ResponseEvent]:
        events = self._open_item(OutputMessage(content=[OutputText(text="")]))
        return events + [self._event(ContentPartEvent, type="response.content_part.added",
                                     item_id=self._open.id, output_index=len(self.output) - 1,
                                     part=OutputText(text=""))]

    def _open_item(self, item: OutputMessage | FunctionCallItem) -> list[ResponseEvent]:
        self.output.append(item)
        self._open = item
        # NOTE: a message is announced with no content part: its part has an event of its own
        announced = item.model_copy(update={"content": []}) if isinstance(item, OutputMessage) \
            else item.model_copy()
        return [self._event(OutputItemEvent, type="response.output_item.added",
                            output_index=len(self.output) - 1, item=announced)]

    def _close(self, status: ItemStatus) -> list[ResponseEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        index = len(self.output) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [self._event(TextDoneEvent, item_id=item.id, output_index=index,
                                  text=part.text),
                      self._event(ContentPartEvent, type="response.content_part.done",
                                  item_id=item.id, output_index=index, part=part.model_copy())]
        else:
            events = [self._event(ArgumentsDoneEvent, item_id=item.id, output_index=index,
                                  name=item.name, arguments=item.arguments)]
        return events + [self._event(OutputItemEvent, type="response.output_item.done",
                                     output_index=index, item=item.model_copy(deep=True))]
