"""POST /v1/responses, GET and DELETE /v1/responses/{id}: a Responses request runs as the chat request
it translates to (server/responses_to_chat.py), down chat's one road (OpenAIServing.prepare_chat and
start), and its answer is built as a Response (server/responses_formatter.py), stored unless the
client said `store: false`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import BaseModel

from server.errors import ApiError
from server.generation import Generation
from server.openai_serving import OpenAIServing, PreparedChat, run_to_end
from server.response_store import ResponseStore, StoredResponse
from server.responses_api import InputItem, ResponsesRequest
from server.responses_formatter import (
    FunctionCallItem,
    OutputMessage,
    ResponseEventStream,
    ResponseObject,
    ResponsesFormatter,
)
from server.responses_to_chat import to_chat
from server.tools.call_reader import ToolCallStream


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def create(self, request: ResponsesRequest, is_disconnected: Callable[[], Any],
                     tenant: str | None) -> ResponseObject | AsyncIterator[str]:
        """`tenant`: the API key's tenant (server/api_key.py); it owns what is stored."""
        history = self._history(request.previous_response_id, tenant)
        translation = to_chat(request, history)
        try:
            prepared = await self.serving.prepare_chat(translation.chat, clamp_max_tokens=True)
            generation = await self.serving.start(prepared, translation.chat, tenant)
        except ApiError as error:
            raise translation.names.error(error) from None
        formatter = ResponsesFormatter(self.serving.served_model_name, request)
        conversation = (*history, *request.input)
        if request.stream:
            return self._stream(generation, prepared, formatter, conversation, tenant)
        await run_to_end(generation, is_disconnected)
        response = formatter.whole(generation, prepared.reader)
        self._keep(response, conversation, tenant)
        return response

    def retrieve(self, response_id: str, tenant: str | None) -> ResponseObject:
        return self._stored(response_id, tenant, "response_id").response

    def delete(self, response_id: str, tenant: str | None) -> DeletedResponse:
        if not self.store.delete(tenant, response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)

    # ------------------------------------------------------------------ internals
    async def _stream(self, generation: Generation, prepared: PreparedChat,
                      formatter: ResponsesFormatter, conversation: tuple[InputItem, ...],
                      tenant: str | None) -> AsyncIterator[str]:
        """Server-sent events, `event:` and `data:` lines each, with no `[DONE]` (OpenAI's)."""
        events = ResponseEventStream(formatter)
        calls = None if prepared.reader is None else ToolCallStream(prepared.reader)
        try:
            for event in events.opening():
                yield event.sse()
            try:
                async for piece in generation.pieces():
                    text, finish_reason = piece.piece.text, piece.piece.finish_reason
                    content, call_deltas = text, []
                    if calls is not None:
                        content, call_deltas, _ = calls.feed(text, finish_reason)
                    for event in events.feed(content, call_deltas):
                        yield event.sse()
            except ApiError as error:
                yield events.failed(error).sse()
                return
            closing, response = events.closing(generation)
            self._keep(response, conversation, tenant)
            for event in closing:
                yield event.sse()
        finally:  # also when the client went away: nothing of this request stays in the engine
            generation.close()

    def _history(self, previous_response_id: str | None,
                 tenant: str | None) -> tuple[InputItem, ...]:
        if previous_response_id is None:
            return ()
        return self._stored(previous_response_id, tenant, "previous_response_id").conversation

    def _stored(self, response_id: str, tenant: str | None, param: str) -> StoredResponse:
        stored = self.store.get(tenant, response_id)
        if stored is None:
            raise _not_found(response_id, param)
        return stored

    def _keep(self, response: ResponseObject, conversation: tuple[InputItem, ...],
              tenant: str | None) -> None:
        if not response.store:
            return
        output = tuple(_as_input(item) for item in response.output)
        self.store.put(tenant, StoredResponse(response, (*conversation, *output)))


def _as_input(item: OutputMessage | FunctionCallItem) -> InputItem:
    """An output item as the input item that sends it back (an output's shape is a valid input)."""
    return InputItem.model_validate(item.model_dump(mode="json"))


def _not_found(response_id: str, param: str) -> ApiError:
    # NOTE: the same answer whether the id never existed, was evicted, or is another tenant's
    return ApiError(404, f"no stored response has the id {response_id!r} (responses are kept in "
                         f"memory, a bounded number per API key, and only with store true)",
                    param=param, code="response_not_found", type="NotFoundError")
