"""/v1/chat/completions responses and stream chunks, from a Generation's choices and pieces."""

from __future__ import annotations

from typing import Any

from engine.request import TokenLogprobs
from server.api_responses import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    ResponseMetrics,
    TopLogprob,
)
from server.generation import ChoicePiece, Generation
from server.response_formatter import ResponseFormatter


class ChatFormatter(ResponseFormatter):
    def __init__(self, tokenizer: Any, model_name: str) -> None:
        super().__init__(tokenizer, model_name, "chatcmpl")

    def response(self, generation: Generation) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.response_id, created=self.created, model=self.model_name,
            choices=[ChatCompletionChoice(
                index=c.index, message=ChatResponseMessage(content=c.tracker.text),
                logprobs=self._logprobs(c.tracker.logprobs), finish_reason=c.tracker.finish_reason)
                for c in generation.choices],
            usage=self.usage(generation), metrics=self.metrics(generation))

    def opening_chunks(self, generation: Generation) -> list[ChatCompletionStreamResponse]:
        """Each choice's first chunk carries the role, as OpenAI's do."""
        return [self._chunk([ChatCompletionStreamChoice(
            index=c.index, delta=DeltaMessage(role="assistant", content=""))])
            for c in generation.choices]

    def piece_chunk(self, piece: ChoicePiece,
                    metrics: ResponseMetrics | None) -> ChatCompletionStreamResponse:
        logprobs = piece.piece.logprobs
        return self._chunk([ChatCompletionStreamChoice(
            index=piece.index, delta=DeltaMessage(content=piece.piece.text or None),
            logprobs=self._logprobs(logprobs) if logprobs else None,
            finish_reason=piece.piece.finish_reason)], metrics=metrics)

    def usage_chunk(self, generation: Generation) -> ChatCompletionStreamResponse:
        return self._chunk([], usage=self.usage(generation), metrics=self.metrics(generation))

    def _chunk(self, choices: list[ChatCompletionStreamChoice],
               **extra: Any) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.response_id, created=self.created,
                                            model=self.model_name, choices=choices, **extra)

    def _logprobs(self, logprobs: list[TokenLogprobs] | None) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = self.token_text(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatChoiceLogprobs(content=[
            ChatTokenLogprob(**top(lp.token_id, lp.logprob).model_dump(),
                             top_logprobs=[top(t, v) for t, v in lp.top]) for lp in logprobs])
