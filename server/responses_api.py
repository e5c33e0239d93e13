"""Pydantic models of OpenAI's Responses API request (POST /v1/responses).

They validate as strictly as the chat request (server/api_requests.py) and name Responses fields in
every error (`input.2.content`, `tools.1.name`, `text.format`), so that translating a valid request
into a chat request (server/responses_to_chat.py) cannot fail on anything the client sent. Unknown
fields are ignored: clients such as Codex send many we have no use for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.sampling_params import MAX_STOP_STRINGS
from engine.structured import ResponseFormatError, parse_response_format
from server.api_requests import (
    MAX_ARGUMENTS_CHARS,
    MAX_CACHE_SALT_CHARS,
    MAX_INT32,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_STOP_TOKEN_IDS,
    Name,
    SamplingKnobFields,
    SpeculativeDecodingOptions,
    StopString,
    TokenId,
)
from server.tools.parsed_calls import FUNCTION_NAME
from server.tools.tool_request import MAX_DESCRIPTION_CHARS, MAX_TOOLS, parse_tools

# the part types whose text the model reads; images, files and audio it cannot
TEXT_PART_TYPES = ("input_text", "output_text")
ItemId = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME.pattern)]
# what one item type needs besides `type`; the other fields are ignored for it
_REQUIRED_BY_TYPE = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "reasoning": (),
}


def _required_for(value: Any, info: ValidationInfo) -> Any:
    """A field that the item's type needs may not be missing (nor null)."""
    item_type = info.data.get("type")
    if value is None and info.field_name in _REQUIRED_BY_TYPE.get(item_type, ()):
        raise ValueError(f"required in a {item_type!r} item")
    return value


def _text_as_parts(value: Any) -> Any:
    """A lone string is one text part, so content and outputs have a single shape."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: str | None = Field(default=None, validate_default=True)

    @field_validator("type")
    @classmethod
    def _text_only(cls, part_type: str) -> str:
        if part_type not in TEXT_PART_TYPES:
            raise ValueError(f"{part_type!r} parts are not supported; this server reads text "
                             f"only ({', '.join(repr(t) for t in TEXT_PART_TYPES)})")
        return part_type

    @field_validator("text")
    @classmethod
    def _text_required(cls, text: str | None, info: ValidationInfo) -> str | None:
        if text is None and "type" in info.data:
            raise ValueError("required in a text part")
        return text


def joined_text(parts: list[ContentPart]) -> str:
    """Text parts joined by newlines, as chat's text parts are (server/api_requests.py)."""
    return "\n".join(part.text or "" for part in parts)


class InputItem(BaseModel):
    """One item of `input`: a message, a function call the model made earlier, that call's output,
    or a reasoning item (accepted and dropped: the model has no use for another's reasoning).
    One model for all types, so errors name the field (`input.2.call_id`), not a union branch."""

    model_config = ConfigDict(strict=True, extra="ignore")

    # an item without a type is a message (OpenAI's "easy input message")
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = Field(
        default=None, validate_default=True)
    content: list[ContentPart] | None = Field(default=None, validate_default=True)
    call_id: ItemId | None = Field(default=None, validate_default=True)
    name: FunctionName | None = Field(default=None, validate_default=True)
    # JSON text of the call's arguments, as the model wrote it
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)] | None = Field(
        default=None, validate_default=True)
    output: list[ContentPart] | None = Field(default=None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _only_the_fields_of_its_type(cls, item: Any) -> Any:
        item_type = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(item_type, str) or item_type not in _REQUIRED_BY_TYPE:
            return item  # not an object, or an unknown type: its own error
        return {key: value for key, value in item.items()
                if key == "type" or key in _REQUIRED_BY_TYPE[item_type]}

    @field_validator("content", "output", mode="before")
    @classmethod
    def _string_is_one_part(cls, value: Any) -> Any:
        return _text_as_parts(value)

    @field_validator("role", "content", "call_id", "name", "arguments", "output")
    @classmethod
    def _present_where_needed(cls, value: Any, info: ValidationInfo) -> Any:
        return _required_for(value, info)

    @property
    def text(self) -> str:
        """A message's text, or a function call output's."""
        return joined_text(self.content if self.type == "message" else self.output or [])


class FunctionTool(BaseModel):
    """A function tool in the Responses shape (flat: no nested `function` object)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    # a JSON schema of type object; None: the function takes no arguments
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_are_a_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        # NOTE: chat's checks (type object, depth, size), so the chat request cannot refuse them
        try:
            parse_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
        except ValueError as error:
            raise ValueError(str(error).replace("tools[0].function.parameters", "parameters")
                             ) from None
        return parameters

    def as_chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters, "strict": self.strict}
        return {"type": "function",
                "function": {key: value for key, value in function.items() if value is not None}}


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    # {"type": "text"} | {"type": "json_object"} |
    # {"type": "json_schema", "name": ..., "schema": {...}, "strict": ..., "description": ...}
    format: dict[str, Any] | None = None

    @field_validator("format")
    @classmethod
    def _format_is_well_formed(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            parse_response_format(chat_response_format(fmt))
        except ResponseFormatError as error:
            raise ValueError(str(error).replace("response_format.json_schema", "text.format")
                             .replace("response_format", "text.format")) from None
        return fmt


def chat_response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` in chat's `response_format` shape (json_schema's fields nest there)."""
    if fmt is None or fmt.get("type") != "json_schema":
        return None if fmt is None else {"type": fmt.get("type")}
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": spec}


class ResponsesRequest(SamplingKnobFields):
    """POST /v1/responses. None means the engine's default, as in chat."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Name | None = None
    input: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    # a system message before everything else; not carried over to a continuing response
    instructions: str | None = None
    previous_response_id: ItemId | None = None
    # kept for GET /v1/responses/{id} and previous_response_id; null = true (OpenAI's default)
    store: bool | None = None
    # not implemented: 400 unless false (the request runs while the client waits)
    background: bool | None = None
    # OpenAI's stored conversations and prompt templates: 400 unless null
    conversation: Any = None
    prompt: Any = None
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    # the chat request's sampling fields and extras, under the same names and bounds (the knobs,
    # temperature, top_p…, come with SamplingKnobFields)
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT32)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    speculative_decoding: SpeculativeDecodingOptions | None = None
    # function tools; tools of other types (web_search, mcp, custom, ...) are left out as None,
    # in place, so the indexes of errors stay those of the request. NOTE: before tool_choice,
    # whose validator reads it
    tools: Annotated[list[FunctionTool | None], Field(max_length=4 * MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # echoed in the response, never read
    metadata: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_is_one_message(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_string_to_list(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, background: bool | None) -> bool | None:
        if background:
            raise ValueError("background responses are not supported; send background false "
                             "(or leave it out) and wait for the response")
        return background

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_supported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"stored {info.field_name}s are not supported; send the items in "
                             "input (or use previous_response_id)")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _skip_tools_the_server_cannot_run(cls, tools: Any) -> Any:
        if not isinstance(tools, list):
            return tools
        return [None if isinstance(tool, dict) and tool.get("type") != "function" else tool
                for tool in tools]

    @field_validator("tools")
    @classmethod
    def _tools_fit_together(cls, tools: list[FunctionTool | None] | None
                            ) -> list[FunctionTool | None] | None:
        functions = [tool for tool in tools or () if tool is not None]
        if len(functions) > MAX_TOOLS:
            raise ValueError(f"has {len(functions)} function tools; at most {MAX_TOOLS}")
        # duplicate names and the schemas' total size, as chat checks them
        parse_tools([tool.as_chat_tool() for tool in functions])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_function(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or "tools" not in info.data:  # an invalid tools has its own error
            return choice
        names = [tool.name for tool in info.data["tools"] or () if tool is not None]
        if choice in ("auto", "none"):
            return choice
        if choice == "required":
            if not names:
                raise ValueError("'required' needs a function tool; this request has none "
                                 "(tools of other types are not run by this server)")
            return choice
        if not isinstance(choice, dict) or choice.get("type") != "function" \
                or not isinstance(choice.get("name"), str):
            raise ValueError("must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                             "\"name\": ...}; this server runs function tools only")
        if choice["name"] not in names:
            raise ValueError(f"names the function {choice['name']!r}, which is not among the "
                             f"function tools" + (f" ({', '.join(names)})" if names else ""))
        return {"type": "function", "name": choice["name"]}

    @property
    def function_tools(self) -> list[tuple[int, FunctionTool]]:
        """(index in `tools`, tool) of each function tool."""
        return [(index, tool) for index, tool in enumerate(self.tools or ()) if tool is not None]

    @property
    def is_stored(self) -> bool:
        return self.store is not False
