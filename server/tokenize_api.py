"""POST /tokenize and /detokenize in vLLM's shape, which benchmark clients and routers call to count
a prompt's tokens the way the server will: a text, or a conversation through the chat template."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.api_requests import MAX_MESSAGES, ChatMessage, Name, TokenId
from server.errors import ApiError
from server.openai_serving import OpenAIServing
from server.tools.tool_request import FunctionSpec, ToolChoice, parse_tools

# token ids one /detokenize call takes at most (a long context's worth)
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(BaseModel):
    """Either `prompt` (a text) or `messages` (a conversation), as vLLM's two request shapes."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Name | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    # a prompt gets the tokenizer's special tokens (BOS) by default; a conversation's template
    # writes its own
    add_special_tokens: bool | None = None
    # with messages: end with the assistant's turn opened, as a chat request would
    add_generation_prompt: bool = True
    tools: Any = None
    return_token_strs: bool = False

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: Any) -> tuple[FunctionSpec, ...] | None:
        return parse_tools(tools)

    @model_validator(mode="after")
    def _one_of_prompt_and_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (a text) and messages (a conversation)")
        if self.tools and self.messages is None:
            raise ValueError("tools: only with messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    # each token as text, when return_token_strs was asked for
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


class Tokenization:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        serving = self._checked(body.model, "prompt" if body.prompt is not None else "messages")
        if body.messages is not None:
            serving.check_messages_size(body.messages)
            choice = ToolChoice("auto" if body.tools else "none")
            tokens = await serving.render_chat(body.messages, body.tools, choice,
                                               add_generation_prompt=body.add_generation_prompt,
                                               add_special_tokens=bool(body.add_special_tokens))
        else:
            serving.check_prompt_size(body.prompt, "prompt")
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await serving.encode(body.prompt, "prompt", add_special_tokens=add_special)
        strs = ([serving.tokenizer.convert_ids_to_tokens(t) for t in tokens]
                if body.return_token_strs else None)
        return TokenizeResponse(count=len(tokens), max_model_len=serving.max_model_len,
                                tokens=tokens, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        serving = self._checked(body.model, "tokens")
        serving.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    def _checked(self, model: str | None, param: str) -> OpenAIServing:
        self.serving.check_model(model)
        if self.serving.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", param=param)
        return self.serving
