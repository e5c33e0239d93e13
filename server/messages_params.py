"""The parts of an Anthropic Messages request: content blocks, messages and tools, validated so
that each error names its field as Anthropic does (`messages.1.content.0.type`), each knowing its
chat counterpart (server/messages_api.py puts them together).

Blocks and messages are tagged unions (by `type`, by `role`); a block of a type this server cannot
take where it stands (an image, a tool_use in a user turn) validates as RejectedBlock, which fails
saying why.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from server.api_requests import MAX_ARGUMENTS_CHARS, MAX_NAME_CHARS, MAX_TOOL_CALLS
from server.tools.parsed_calls import FUNCTION_NAME
from server.tools.tool_request import MAX_DESCRIPTION_CHARS

STRICT = ConfigDict(strict=True, extra="ignore")
ToolUseId = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
# NOTE: chat's rule for function names (64 characters; Anthropic allows 128)
ToolName = Annotated[str, Field(pattern=FUNCTION_NAME.pattern)]
# Anthropic's server tools (which Anthropic runs, not the client) are typed like web_search_20250305
SERVER_TOOL_TYPE = re.compile(r"^[a-z_]+_\d{8}$")


# ---------------------------------------------------------------------- content blocks
class TextBlock(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    """An earlier turn's reasoning (`thinking` or `redacted_thinking`): accepted, never shown."""

    model_config = STRICT

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(BaseModel):
    """A call an earlier assistant turn made."""

    model_config = STRICT

    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: dict[str, Any]

    @field_validator("input")
    @classmethod
    def _input_is_bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        if len(json.dumps(value)) > MAX_ARGUMENTS_CHARS:
            raise ValueError(f"at most {MAX_ARGUMENTS_CHARS} characters of JSON")
        return value

    @property
    def arguments(self) -> str:
        return json.dumps(self.input, ensure_ascii=False)


class RejectedBlock(BaseModel):
    """A block of a type this server cannot take where it stands: validating it says why."""

    model_config = STRICT

    type: str

    @field_validator("type")
    @classmethod
    def _say_why(cls, block_type: str) -> str:
        if block_type == "tool_use":
            raise ValueError("tool_use blocks belong in assistant messages")
        if block_type == "tool_result":
            raise ValueError("tool_result blocks belong in user messages")
        if block_type in ("image", "document", "search_result"):
            raise ValueError(f"{block_type} blocks are not supported: this server's models read "
                             "text only")
        raise ValueError(f"unsupported content block type {block_type!r}")


def _block_tag(*allowed: str):
    """The union tag of a content block: `<type> block` where its type is allowed, else
    `rejected block`; None (an error) when it has no string type."""
    def tag(value: Any) -> str | None:
        block_type = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if not isinstance(block_type, str):
            return None
        if block_type == "redacted_thinking":
            block_type = "thinking"
        return f"{block_type} block" if block_type in allowed else "rejected block"
    return tag


def _blocks_discriminator(*allowed: str) -> Discriminator:
    return Discriminator(_block_tag(*allowed), custom_error_type="content_block",
                         custom_error_message="must be a content block: an object with a string "
                                              "'type'")


def _text_as_blocks(content: object) -> object:
    """A plain string is one text block, as Anthropic reads it."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError("must be a string or a list of content blocks")
    return content


_Text = Annotated[TextBlock, Tag("text block")]
_Rejected = Annotated[RejectedBlock, Tag("rejected block")]
TextBlocks = Annotated[list[Annotated[_Text | _Rejected, _blocks_discriminator("text")]],
                       BeforeValidator(_text_as_blocks)]


class ToolResultBlock(BaseModel):
    """The client's answer to an earlier tool_use, in the user message right after it."""

    model_config = STRICT

    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    # a string, text blocks, or nothing
    content: TextBlocks | None = None
    is_error: bool = False

    @property
    def text(self) -> str:
        text = "\n".join(block.text for block in self.content or ())
        # NOTE: the model has no other way to know the call failed
        return f"Error: {text}" if self.is_error else text


_Thinking = Annotated[ThinkingBlock, Tag("thinking block")]
UserBlocks = Annotated[
    list[Annotated[_Text | Annotated[ToolResultBlock, Tag("tool_result block")] | _Thinking
                   | _Rejected, _blocks_discriminator("text", "tool_result", "thinking")]],
    BeforeValidator(_text_as_blocks)]
AssistantBlocks = Annotated[
    list[Annotated[_Text | Annotated[ToolUseBlock, Tag("tool_use block")] | _Thinking
                   | _Rejected, _blocks_discriminator("text", "tool_use", "thinking")]],
    BeforeValidator(_text_as_blocks)]


# ---------------------------------------------------------------------- messages
class UserMessage(BaseModel):
    model_config = STRICT

    role: Literal["user"]
    content: UserBlocks

    def chat_messages(self) -> list[dict[str, Any]]:
        """Tool results first, as chat tool messages, then the text as one user turn."""
        results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
                   for block in self.content if isinstance(block, ToolResultBlock)]
        texts = [block.text for block in self.content if isinstance(block, TextBlock)]
        if texts or not results:
            return [*results, {"role": "user", "content": "\n".join(texts)}]
        return results


class AssistantMessage(BaseModel):
    model_config = STRICT

    role: Literal["assistant"]
    content: AssistantBlocks

    @field_validator("content")
    @classmethod
    def _calls_are_bounded(cls, content: list[Any]) -> list[Any]:
        if sum(isinstance(block, ToolUseBlock) for block in content) > MAX_TOOL_CALLS:
            raise ValueError(f"at most {MAX_TOOL_CALLS} tool_use blocks in one message")
        return content

    @property
    def tool_uses(self) -> list[ToolUseBlock]:
        return [block for block in self.content if isinstance(block, ToolUseBlock)]

    def chat_messages(self) -> list[dict[str, Any]]:
        texts = [block.text for block in self.content if isinstance(block, TextBlock)]
        calls = [{"id": call.id, "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}
                 for call in self.tool_uses]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return [message]


class SystemMessage(BaseModel):
    """Instructions in the midst of the conversation (Claude Code appends its environment so)."""

    model_config = STRICT

    role: Literal["system"]
    content: TextBlocks

    def chat_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "\n".join(block.text for block in self.content)}]


def _role_tag(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return f"{role} message" if role in ("user", "assistant", "system") else None


MessageParam = Annotated[
    Annotated[UserMessage, Tag("user message")]
    | Annotated[AssistantMessage, Tag("assistant message")]
    | Annotated[SystemMessage, Tag("system message")],
    Discriminator(_role_tag, custom_error_type="message_role",
                  custom_error_message="must be a message with role 'user', 'assistant' or "
                                       "'system'")]


# ---------------------------------------------------------------------- tools
class CustomTool(BaseModel):
    """A tool the client runs: what the model may call."""

    model_config = STRICT

    type: Literal["custom"] | None = None
    name: ToolName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    # a JSON schema of type object; checked as chat checks a function's parameters
    input_schema: dict[str, Any]
    # Anthropic's tool search: not shown to the model until a search loads it (here: never)
    defer_loading: bool = False

    def as_chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ServerTool(BaseModel):
    """One of Anthropic's own tools (web search, code execution, ...): skipped, as this server
    runs none of them."""

    model_config = STRICT

    type: str


def _tool_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    tool_type = value.get("type")
    if tool_type in (None, "custom"):
        return "custom tool"
    if isinstance(tool_type, str) and SERVER_TOOL_TYPE.match(tool_type):
        return "server tool"
    return None


ToolParam = Annotated[
    Annotated[CustomTool, Tag("custom tool")] | Annotated[ServerTool, Tag("server tool")],
    Discriminator(_tool_tag, custom_error_type="tool",
                  custom_error_message="must be a custom tool {name, description, input_schema}"
                                       " (type absent or 'custom'), or one of Anthropic's server "
                                       "tools (a type like 'web_search_20250305'), which are "
                                       "skipped")]


class ToolChoiceParam(BaseModel):
    model_config = STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


# NOTE: union tags appear in pydantic's error locations; field paths leave them out
UNION_TAGS = frozenset({f"{kind} block" for kind in ("text", "thinking", "tool_use", "tool_result",
                                                     "rejected")}
                       | {"user message", "assistant message", "system message", "custom tool",
                          "server tool"})
