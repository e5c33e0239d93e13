"""Pydantic models of OpenAI's Completions and Chat Completions requests, plus specserve's extras.

They validate strictly: JSON types must match, since OpenAI rejects "0.5" for a number. Each error
names its field. Unknown fields are ignored, because SDKs send fields we have no use for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    create_model,
    field_validator,
    model_validator,
)

from engine.sampling_params import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    Knob,
    SamplingParams,
    sampling_knobs,
)
from engine.structured import ResponseFormat, parse_response_format
from server.tools.parsed_calls import FUNCTION_NAME
from server.tools.tool_request import FunctionSpec, ToolChoice, parse_tool_choice, parse_tools

# NOTE: token ids get no upper bound here; the server checks them against the vocabulary
TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
# cache_salt: long enough for any digest or tenant name, short enough to cost nothing
MAX_CACHE_SALT_CHARS = 256
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
# logit_bias keys: token ids written as decimal integers, as OpenAI's SDKs send them (JSON object
# keys are strings); ten digits hold any vocabulary
MAX_TOKEN_ID_DIGITS = 10
# NOTE: caps on what a client sends, so that validating, copying and sending one request stays
# cheap for the event loop (8,000,000 stop_token_ids once held /health for 12.7 s)
MAX_STOP_TOKEN_IDS = 1024
# prompts x n of one request: each is an engine request (OpenAI caps n at 128)
MAX_CHOICES_PER_REQUEST = 256
MAX_MESSAGES = 2048
# model, user and message names: identifiers, not text
MAX_NAME_CHARS = 256
# calls in one assistant message of the history, and the JSON text of one call's arguments
MAX_TOOL_CALLS = 128
MAX_ARGUMENTS_CHARS = 1_000_000
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class SpeculativeDecodingOptions(BaseModel):
    """The `speculative_decoding` request extra: per-request control over speculation."""

    # NOTE: forbid unknown keys here: a misspelled option of our own extension must not pass silently
    model_config = ConfigDict(strict=True, extra="forbid")

    enabled: bool = True
    # cap on this request's k; 0 = off. The server rejects a cap above its own k.
    num_speculative_tokens: Annotated[int, Field(ge=0)] | None = None

    @property
    def num_speculative_tokens_cap(self) -> int | None:
        """SamplingParams.num_speculative_tokens: 0 when disabled (a disabled request ignores its cap)."""
        return 0 if not self.enabled else self.num_speculative_tokens


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    # send one last chunk with `usage` (and `choices: []`) before [DONE]
    include_usage: bool = False


def _deprecated(value: Any, neutral: Any, replacement: str) -> Any:
    if value is not None and value != neutral:
        raise ValueError(f"deprecated by OpenAI and not supported; use {replacement}")
    return value


def _not_implemented(value: Any, *neutral: Any) -> Any:
    """A field specserve does not implement yet may be absent or neutral; any other value is a 400,
    since a client that asked for JSON output or tool calls must not get plain text silently."""
    if value is not None and not any(value == n for n in neutral):
        allowed = " or ".join(dict.fromkeys(["null", *(repr(n) for n in neutral)]))
        raise ValueError(f"not supported by specserve yet; only {allowed} is accepted")
    return value


def _knob_field(kind: type, declaration: Knob) -> tuple[Any, None]:
    """An optional request field for a SamplingParams knob, bounded by its `api` interval. NaN and
    Infinity (which Python's JSON reader accepts) get a message of their own."""
    interval = declaration.api
    bounds = {"gt" if interval.low_open else "ge": interval.low, "le": interval.high}
    if kind is float:
        bounds["allow_inf_nan"] = False
    return Annotated[kind, Field(**bounds)] | None, None


# SamplingParams' knobs (temperature, top_p, top_k, the penalties, min_p: engine/sampling_params.py
# declares each once, with its range) as request fields of the same names, None = the default:
# chat's, completions' and the Responses API's
SamplingKnobFields = create_model(
    "SamplingKnobFields", __config__=ConfigDict(strict=True, extra="ignore"),
    **{name: _knob_field(kind, declaration) for name, (kind, declaration) in sampling_knobs().items()})


class _GenerationRequest(SamplingKnobFields):
    """Fields that Completions and Chat Completions share, beside the sampling knobs. None means
    the engine's default."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Name | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    # NOTE: stream comes before stream_options: the latter's validator reads it
    stream: bool = False
    stream_options: StreamOptions | None = None
    # a lone string is normalised to a one-item list
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    # {"token id": bias}; the server checks the ids against the vocabulary
    logit_bias: Annotated[dict[str, LogitBias],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    user: Name | None = None
    # not implemented: 400 unless neutral (null, 1 or n), on both endpoints
    best_of: Any = None
    # extensions (vLLM)
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT32)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # extension (vLLM): state that outlives this request (suffix decoding's output cache, later
    # prefix-cache blocks) is shared only with requests of the same API key and cache_salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # specserve extra
    speculative_decoding: SpeculativeDecodingOptions | None = None
    # {"type": "text" | "json_object" | "json_schema", ...}: JSON output enforced by a grammar at
    # every position, drafts included (engine/structured/). Its shape, size and depth are checked
    # here; whether the grammar can enforce it (up to ~1 s for a large schema) on a thread by the
    # server (server/openai_serving.py), so a bad schema is a 400 before it reaches the engine
    response_format: Any = None

    @field_validator("response_format")
    @classmethod
    def _response_format_is_well_formed(cls, response_format: Any) -> ResponseFormat | None:
        return parse_response_format(response_format)

    @field_validator("best_of")
    @classmethod
    def _best_of_must_be_n(cls, best_of: Any, info: ValidationInfo) -> Any:
        return _not_implemented(best_of, 1, info.data.get("n", 1))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_string_to_list(cls, stop: object) -> object:
        return [stop] if isinstance(stop, str) else stop

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None,
                                    info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"keys must be token ids written as decimal integers, got {key!r}")
        return bias

    @property
    def logit_bias_token_ids(self) -> list[int]:
        return [int(key) for key in self.logit_bias or {}]

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         grammar: ResponseFormat | None = None) -> SamplingParams:
        """`grammar`: the server's own (a tool call's) in place of the request's response_format."""
        spec = self.speculative_decoding
        grammar = grammar or self.response_format
        given = {
            **{name: getattr(self, name) for name in sampling_knobs()},
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "num_speculative_tokens": spec.num_speculative_tokens_cap if spec else None,
            "logit_bias": None if self.logit_bias is None else {
                int(key): value for key, value in self.logit_bias.items()},
            "response_format": None if grammar is None else grammar.key,
        }
        # NOTE: unset fields fall back to SamplingParams' defaults, the one place defaults live
        kwargs = {name: value for name, value in given.items() if value is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, n=self.n,
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, **kwargs)


PROMPT_SHAPE_ERROR = ("must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists (token ids are non-negative integers)")


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    # several prompts in one list are allowed, as with OpenAI: each gets n choices
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    # top-N alternatives per token (OpenAI caps completions at 5; we allow MAX_LOGPROBS)
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    # not implemented: 400 unless neutral
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _suffix_must_be_empty(cls, suffix: Any) -> Any:
        return _not_implemented(suffix, "")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_has_one_shape(cls, prompt: object, validate: ValidatorFunctionWrapHandler) -> Any:
        # NOTE: one clear message instead of one error per branch of the union
        try:
            prompt = validate(prompt)
        except ValidationError:
            raise ValueError(PROMPT_SHAPE_ERROR) from None
        if not prompt or (isinstance(prompt, list)
                           and any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("must not be empty (nor may any prompt in its list)")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _choices_are_bounded(cls, prompt: Any, info: ValidationInfo) -> Any:
        num_prompts = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) \
            else 1
        n = info.data.get("n", 1)
        if num_prompts * n > MAX_CHOICES_PER_REQUEST:
            raise ValueError(f"{num_prompts} prompts x n {n} = {num_prompts * n} completions; at "
                             f"most {MAX_CHOICES_PER_REQUEST} per request")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt on its own: a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """`default_max_tokens` (the room left in the context) applies when max_tokens is null."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: Annotated[str, Field(pattern=FUNCTION_NAME.pattern)]
    # JSON text, as the model's response gave it
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)]


class AssistantToolCall(BaseModel):
    """A call an earlier assistant turn made, sent back in the history."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; `content` is always plain text once validated (text parts joined by newlines)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # None only for an assistant message (OpenAI allows it when the message carried tool calls)
    content: str | None = Field(default=None, validate_default=True)
    name: Name | None = None
    # an assistant message's calls; a tool message's answer to one of them
    tool_calls: Annotated[list[AssistantToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: object) -> object:
        if not isinstance(content, list):
            return content
        texts = []
        for index, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type != "text":
                raise ValueError(f"part {index} has type {part_type!r}; only 'text' parts are "
                                 "supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {index} needs a string 'text'")
            texts.append(part["text"])
        # NOTE: joined with newlines, as vLLM does
        return "\n".join(texts)

    @field_validator("content")
    @classmethod
    def _content_required_unless_assistant(cls, content: str | None,
                                           info: ValidationInfo) -> str | None:
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("required (only an assistant message may have null content)")
        return content

    @model_validator(mode="after")
    def _tool_fields_match_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: required in a tool message (the id of the call it "
                             "answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message answers a call")
        return self


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    # deprecated by OpenAI in favour of max_completion_tokens, which wins when both are given
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    # NOTE: logprobs comes before top_logprobs: the latter's validator reads it
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # function calling (server/tools/). NOTE: tools comes before tool_choice: the latter's
    # validator reads it
    tools: Any = None
    tool_choice: Any = Field(default=None, validate_default=True)
    parallel_tool_calls: bool = True
    # OpenAI's deprecated forms of tools and tool_choice: 400 unless neutral
    functions: Any = None
    function_call: Any = None

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: Any) -> tuple[FunctionSpec, ...] | None:
        return parse_tools(tools)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, tool_choice: Any, info: ValidationInfo) -> ToolChoice:
        if "tools" not in info.data:  # tools itself was invalid; its error is enough
            return ToolChoice("none")
        return parse_tool_choice(tool_choice, info.data["tools"])

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, functions: Any) -> Any:
        return _deprecated(functions, [], "tools")

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, function_call: Any) -> Any:
        return _deprecated(function_call, "none", "tool_choice")

    @field_validator("messages")
    @classmethod
    def _tool_messages_answer_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        """Each tool message answers a call of the assistant message before it (OpenAI's rule)."""
        open_calls: set[str] = set()
        for index, message in enumerate(messages):
            if message.role == "assistant":
                open_calls = {call.id for call in message.tool_calls or ()}
            elif message.role == "tool":
                if message.tool_call_id not in open_calls:
                    raise ValueError(f"messages[{index}].tool_call_id {message.tool_call_id!r} "
                                     "answers no call of the assistant message before it")
            else:
                open_calls = set()
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None,
                                    info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("only allowed when logprobs is true")
        return top_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def functions_offered(self) -> tuple[FunctionSpec, ...]:
        return self.tools or ()

    def to_sampling_params(self, default_max_tokens: int,
                           grammar: ResponseFormat | None = None) -> SamplingParams:
        """`default_max_tokens` (the room left in the context) applies when no max is given;
        `grammar` forces tool calls (server/tools/forced_calls.py)."""
        max_tokens = self.requested_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(default_max_tokens if max_tokens is None else max_tokens,
                                     logprobs, grammar)
