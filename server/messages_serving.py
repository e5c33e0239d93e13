"""POST /v1/messages and /v1/messages/count_tokens: an Anthropic request validated and translated
(server/messages_api.py), then served down the one chat road (`prepare_chat`, `start`), so
speculation, grammars, tool-call parsing, queue limits and metrics are exactly chat's; the answer
is Anthropic's Message, or its SSE events (server/messages_formatter.py)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from server.api_requests import ChatCompletionRequest
from server.errors import ApiError
from server.generation import Generation
from server.messages_api import MessagesCountTokensRequest, MessagesRequest
from server.messages_errors import AnthropicError
from server.messages_formatter import MessagesFormatter, TokenCount
from server.openai_serving import OpenAIServing, PreparedChat, run_to_end

# the prompt's size in chat's context_length_exceeded messages
_PROMPT_TOKENS = re.compile(r"the prompt has (\d+) tokens")


class MessagesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: Any, is_disconnected: Callable[[], Any],
                     tenant: str | None = None) -> BaseModel | AsyncIterator[str]:
        """`body`: the request's JSON object; `tenant`: the API key's (server/api_key.py)."""
        request = MessagesRequest.parse(body)
        chat = request.to_chat_request()
        prepared = await self._prepare(request, chat)
        formatter = MessagesFormatter(request.model, prepared.reader)
        generation = await self.serving.start(prepared, chat, tenant)
        if request.stream:
            return _stream(generation, formatter)
        await run_to_end(generation, is_disconnected)
        return formatter.message(generation)

    async def count_tokens(self, body: Any) -> TokenCount:
        """The prompt's tokens as /v1/messages would render it, tools included."""
        request = MessagesCountTokensRequest.parse(body)
        prepared = await self._prepare(request, request.to_chat_request())
        return TokenCount(input_tokens=len(prepared.prompt))

    async def _prepare(self, request: MessagesCountTokensRequest,
                       chat: ChatCompletionRequest) -> PreparedChat:
        """`prepare_chat` with max_tokens cut to the room in the context (Anthropic's clients
        send 32000 whatever the model); its errors name this request's fields, not chat's."""
        try:
            return await self.serving.prepare_chat(chat, clamp_max_tokens=True)
        except ApiError as error:
            if error.code == "context_length_exceeded":
                error.message, error.param = self._too_long(error.message), None
            else:
                error.message = request.anthropic_names(error.message)
                error.param = error.param and request.anthropic_names(error.param)
            raise

    def _too_long(self, message: str) -> str:
        """Anthropic's words for a prompt the context cannot hold, which clients read: Claude
        Code compacts the conversation on `prompt is too long: N tokens > M maximum`."""
        num_tokens = _PROMPT_TOKENS.search(message)
        if num_tokens is None:  # refused by its characters, before tokenizing
            return f"prompt is too long: {message}"
        # NOTE: the longest prompt that leaves room for one token to generate
        return (f"prompt is too long: {num_tokens[1]} tokens > {self.serving.max_model_len - 1}"
                f" maximum")


async def _stream(generation: Generation, formatter: MessagesFormatter) -> AsyncIterator[str]:
    """Anthropic's SSE events; an engine failure midway is an `error` event, as Anthropic's."""
    try:
        for event in formatter.opening_events(generation):
            yield _sse(event.type, event.model_dump(mode="json"))
        try:
            async for piece in generation.pieces():
                for event in formatter.piece_events(piece.piece.text, piece.piece.finish_reason):
                    yield _sse(event.type, event.model_dump(mode="json"))
            for event in formatter.closing_events(generation):
                yield _sse(event.type, event.model_dump(mode="json"))
        except ApiError as error:
            yield _sse("error", AnthropicError.from_api_error(error).model_dump(mode="json"))
    finally:  # also when the client went away: nothing of this request stays in the engine
        generation.close()


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
