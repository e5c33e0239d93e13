"""Anthropic's Messages API requests (POST /v1/messages and /v1/messages/count_tokens): validated
with errors that name Anthropic's fields (`messages.1.content.0.type`), then translated into the
chat request that the one chat road serves (server/openai_serving.py `prepare_chat`).

Everything the chat request would refuse is refused here first, under its Anthropic name, so the
translation fails only on the schema of `output_config.format` (structured output, chat's
`response_format`), also named as Anthropic names it. Fields of Anthropic's that change nothing here
(`metadata`, `thinking`, `context_management`, `output_config.effort`, `cache_control`, betas) are
ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from engine.sampling_params import MAX_STOP_STRINGS
from server.api_requests import (
    MAX_INT32,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    ChatCompletionRequest,
    SpeculativeDecodingOptions,
    StopString,
)
from server.errors import ApiError, ErrorResponse
from server.messages_params import (
    STRICT,
    UNION_TAGS,
    AssistantMessage,
    CustomTool,
    MessageParam,
    SystemMessage,
    TextBlocks,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlock,
    UserMessage,
)
from server.tools.tool_request import MAX_TOOLS, parse_tools

# a chat tool's fields in parse_tools' messages, and their Anthropic names
_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.(name|description|parameters)")
# chat's structured-output field (and its schema's place in it), Anthropic's output_config.format
_CHAT_RESPONSE_FORMAT = re.compile(r"response_format(\.json_schema)?")
_ANTHROPIC_TOOL_FIELD = {"name": "name", "description": "description", "parameters": "input_schema"}


# ---------------------------------------------------------------------- requests
class MessagesCountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what makes the prompt."""

    model_config = STRICT

    model: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    # a string or text blocks
    system: TextBlocks | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceParam | None = None

    @classmethod
    def parse(cls, body: Any) -> MessagesCountTokensRequest:
        """The validated request, or an ApiError 400 whose message names the field at fault."""
        try:
            request = cls.model_validate(body)
        except ValidationError as error:
            errors = [{**e, "loc": tuple(p for p in e["loc"] if p not in UNION_TAGS)}
                      for e in error.errors(include_url=False)]
            info = ErrorResponse.from_validation_errors(errors).error
            raise ApiError(400, info.message, param=info.param) from None
        request._check_tools()
        request._check_conversation()
        return request

    # ------------------------------------------------------------------ checks across fields
    @property
    def custom_tools(self) -> list[tuple[int, CustomTool]]:
        """(index in `tools`, tool) of the tools the model may call: the client's own, loaded."""
        return [(index, tool) for index, tool in enumerate(self.tools or ())
                if isinstance(tool, CustomTool) and not tool.defer_loading]

    def anthropic_names(self, text: str) -> str:
        """`text` with chat's fields (`tools[0].function.parameters`, `response_format`) named as
        this request names them (`tools.2.input_schema`, `output_config.format`)."""
        indices = [index for index, _ in self.custom_tools]

        def rename(match: re.Match[str]) -> str:
            return f"tools.{indices[int(match[1])]}.{_ANTHROPIC_TOOL_FIELD[match[2]]}"
        text = _CHAT_RESPONSE_FORMAT.sub("output_config.format", text)
        return _CHAT_TOOL_FIELD.sub(rename, text)

    def _check_tools(self) -> None:
        """The schemas as chat checks them (object type, depth, size, unique names)."""
        try:
            parse_tools([tool.as_chat_tool() for _, tool in self.custom_tools])
        except ValueError as error:
            message = self.anthropic_names(str(error))
            field = re.match(r"tools\.\d+\.\w+", message)
            raise ApiError(400, message if field else f"tools: {message}",
                           param=field[0] if field else "tools") from None
        choice = self.tool_choice
        names = [tool.name for _, tool in self.custom_tools]
        if choice is None or choice.type in ("auto", "none"):
            return
        if not names:
            raise ApiError(400, f"tool_choice.type: {choice.type!r} needs tools; this request "
                                "has none the model can call", param="tool_choice.type")
        if choice.type == "tool" and choice.name not in names:
            raise ApiError(400, f"tool_choice.name: {choice.name!r} is not a tool of this request "
                                f"({', '.join(names)})", param="tool_choice.name")

    def _check_conversation(self) -> None:
        """Each tool_result answers a tool_use of the assistant message right before it, and the
        conversation ends with the user (an assistant prefill is not continued here)."""
        # NOTE: system messages move to the system prompt (_chat_messages), so they sit between
        # nothing: a tool_result answers the assistant message before it, system ones aside
        conversation = [(index, message) for index, message in enumerate(self.messages)
                        if not isinstance(message, SystemMessage)]
        for place, (index, message) in enumerate(conversation):
            if not isinstance(message, UserMessage):
                continue
            before = conversation[place - 1][1] if place else None
            open_ids = {call.id for call in before.tool_uses} \
                if isinstance(before, AssistantMessage) else set()
            for position, block in enumerate(message.content):
                if isinstance(block, ToolResultBlock) and block.tool_use_id not in open_ids:
                    param = f"messages.{index}.content.{position}.tool_use_id"
                    raise ApiError(400, f"{param}: {block.tool_use_id!r} answers no tool_use "
                                        "block of the assistant message before it", param=param)
        if isinstance(self.messages[-1], AssistantMessage):
            param = f"messages.{len(self.messages) - 1}.role"
            raise ApiError(400, f"{param}: the last message must be the user's; continuing an "
                                "assistant message (prefill) is not supported", param=param)
        if len(self._chat_messages()) > MAX_MESSAGES:
            raise ApiError(400, f"messages: with tool results as messages of their own, this "
                                f"conversation has more than {MAX_MESSAGES} turns",
                           param="messages")

    # ------------------------------------------------------------------ translation
    def _chat_messages(self) -> list[dict[str, Any]]:
        """System messages within `messages` (Claude Code sends its environment as one after the
        user's question) join the system prompt, in order: most chat templates take one system
        message, first, and a small model answers the last turn it sees, which should be the
        user's."""
        system = [block.text for block in self.system or ()]
        system += [block.text for message in self.messages if isinstance(message, SystemMessage)
                   for block in message.content]
        return ([{"role": "system", "content": "\n".join(system)}] if system else []) + [
            chat for message in self.messages if not isinstance(message, SystemMessage)
            for chat in message.chat_messages()]

    def _chat_fields(self, may_force: bool) -> dict[str, Any]:
        """`may_force`: tool_choice "any" and "tool" force a call (a grammar); without it they are
        "auto", which shows the model the same prompt."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        tools = [tool.as_chat_tool() for _, tool in self.custom_tools]
        if not tools:
            return fields
        fields["tools"] = tools
        choice = self.tool_choice
        if choice is None:
            return fields
        forced = {"any": "required",
                  "tool": {"type": "function", "function": {"name": choice.name}}}
        fields["tool_choice"] = forced[choice.type] if may_force and choice.type in forced \
            else "none" if choice.type == "none" else "auto"
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return fields

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt is this one's, asking for one token (for counting)."""
        return _chat_request({**self._chat_fields(False), "max_tokens": 1})


class OutputFormat(BaseModel):
    """Anthropic's structured output: the answer is JSON that validates against `schema`."""

    model_config = STRICT

    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(BaseModel):
    """`output_config`: `format` is enforced; `effort` and the rest are ignored."""

    model_config = STRICT

    format: OutputFormat | None = None


class MessagesRequest(MessagesCountTokensRequest):
    """POST /v1/messages."""

    # required, as Anthropic's; clients send large values (32000), cut to the room in the context
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    # Anthropic's range
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_INT32)] | None = None
    stream: bool = False
    # specserve extra, as in chat
    speculative_decoding: SpeculativeDecodingOptions | None = None
    # its `format` runs as chat's response_format (a grammar at every position, drafts included)
    output_config: OutputConfig | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        output_format = self.output_config and self.output_config.format
        given = {"max_tokens": self.max_tokens, "stop": self.stop_sequences,
                 "response_format": None if output_format is None else {
                     "type": "json_schema",
                     "json_schema": {"name": "output", "schema": output_format.schema_,
                                     "strict": True}},
                 "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "stream": self.stream,
                 "speculative_decoding": None if self.speculative_decoding is None
                 else self.speculative_decoding.model_dump()}
        try:
            return _chat_request(
                {**self._chat_fields(True), **{k: v for k, v in given.items() if v is not None}})
        except ApiError as error:  # the schema of output_config.format, as chat checks it
            error.message = self.anthropic_names(error.message)
            error.param = error.param and self.anthropic_names(error.param)
            raise


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # NOTE: only output_config.format's schema is checked here
        info = ErrorResponse.from_validation_errors(error.errors(include_url=False)).error
        raise ApiError(400, info.message, param=info.param) from None
