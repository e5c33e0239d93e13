"""A Responses request as the chat request it runs as, so speculation, grammars, tool parsers and
queue limits are exactly chat's; and the chat fields that errors name, put back in Responses terms.

    instructions                  -> a system message first
    message item                  -> a message of the same role, text parts joined
    function_call items in a row  -> one assistant message with tool_calls (joined to the
                                     assistant message right before them, if any)
    function_call_output item     -> a tool message answering its call_id
    reasoning item                -> nothing
    flat function tools           -> chat's nested {"type": "function", "function": {...}}
    text.format                   -> response_format
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.sampling_params import sampling_knobs
from server.api_requests import ChatCompletionRequest
from server.errors import ApiError, ErrorResponse
from server.responses_api import InputItem, ResponsesRequest, chat_response_format

# where a chat message came from, as an error names it
INSTRUCTIONS = "instructions"
HISTORY = "previous_response_id"

_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function")
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"))


@dataclass(frozen=True)
class ChatNames:
    """Chat field names back to the Responses fields they came from."""

    # per chat message: "instructions", "previous_response_id" or "input.i"
    message_sources: tuple[str, ...]
    # per chat tool: its index in the Responses request's `tools`
    tool_sources: tuple[int, ...]

    def param(self, chat_param: str | None) -> str | None:
        if chat_param is None:
            return None
        if chat_param == "messages":
            return "input"
        if chat_param.startswith("messages."):
            index = chat_param.split(".")[1]
            return self.message_sources[int(index)] if index.isdigit() else "input"
        return self.text(chat_param)

    def text(self, text: str) -> str:
        """`text` (a param or a message) with every chat field name in it renamed."""
        text = _CHAT_TOOL.sub(lambda m: f"tools.{self.tool_sources[int(m.group(1))]}", text)
        for chat_name, name in _RENAMES:
            text = text.replace(chat_name, name)
        return re.sub(r"^messages has", "input has", text)

    def error(self, error: ApiError) -> ApiError:
        return ApiError(error.status, self.text(error.message), param=self.param(error.param),
                        code=error.code, type=error.type, retry_after=error.retry_after)


@dataclass(frozen=True)
class ChatTranslation:
    chat: ChatCompletionRequest
    names: ChatNames


def to_chat(request: ResponsesRequest, history: Sequence[InputItem] = ()) -> ChatTranslation:
    """The chat request `request` runs as, after `history` (the conversation of the response it
    continues). Raises ApiError (400) naming the Responses field at fault."""
    messages, sources = _messages(request, history)
    functions = request.function_tools
    names = ChatNames(tuple(sources), tuple(index for index, _ in functions))
    body = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        **{name: getattr(request, name) for name in sampling_knobs()},
        "seed": request.seed,
        "stop": request.stop,
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "stop_token_ids": request.stop_token_ids,
        "cache_salt": request.cache_salt,
        "speculative_decoding": (None if request.speculative_decoding is None
                                 else request.speculative_decoding.model_dump()),
        "tools": [tool.as_chat_tool() for _, tool in functions] or None,
        "tool_choice": _chat_tool_choice(request.tool_choice, bool(functions)),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": chat_response_format(request.text and request.text.format),
    }
    try:
        chat = ChatCompletionRequest.model_validate(
            {key: value for key, value in body.items() if value is not None})
    except ValidationError as error:
        # NOTE: a safety net: the Responses model checks what chat checks, so this is rare (a
        # history that grew past chat's limits), and it still names the Responses field
        raise _renamed_validation_error(error, names) from None
    return ChatTranslation(chat, names)


def _messages(request: ResponsesRequest, history: Sequence[InputItem]
              ) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages and, for each, the Responses field it came from."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        sources.append(INSTRUCTIONS)
    # the call ids that the last assistant message made: what a tool message may answer
    open_calls: set[str] = set()
    items = [(HISTORY, item) for item in history]
    items += [(f"input.{index}", item) for index, item in enumerate(request.input)]
    for source, item in items:
        if item.type == "message":
            messages.append({"role": item.role, "content": item.text})
            sources.append(source)
            open_calls = set()
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(source)
                open_calls = set()
            open_calls.add(item.call_id)
        elif item.type == "function_call_output":
            if item.call_id not in open_calls:
                raise ApiError(400, f"{source}.call_id {item.call_id!r} answers no function_call "
                                    "item of the turn before it", param=f"{source}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            sources.append(source)
    if not messages:
        raise ApiError(400, "input has no message, function_call or function_call_output item "
                            "(reasoning items alone are dropped)", param="input")
    return messages, sources


def _chat_tool_choice(choice: Any, has_functions: bool) -> Any:
    """`tool_choice` in chat's shape; without function tools only "none" remains."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice if has_functions else None


def _renamed_validation_error(error: ValidationError, names: ChatNames) -> ApiError:
    errors = [{**e, "loc": tuple(names.param(".".join(str(p) for p in e["loc"])).split("."))}
              for e in error.errors()]
    body = ErrorResponse.from_validation_errors(errors).error
    return ApiError(400, names.text(body.message), param=body.param)
