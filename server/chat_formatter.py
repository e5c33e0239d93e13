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
from server.generation import Choice, ChoicePiece, Generation
from server.response_formatter import ResponseFormatter
from server.tools.call_reader import ToolCallReader, ToolCallStream


class ChatFormatter(ResponseFormatter):
    def __init__(self, tokenizer: Any, model_name: str,
                 tool_calls: ToolCallReader | None = None) -> None:
        """`tool_calls`: how to read calls out of the text; None when the request may make none."""
        super().__init__(tokenizer, model_name, "chatcmpl")
        self.tool_calls = tool_calls
        self._streams: dict[int, ToolCallStream] = {}

    def response(self, generation: Generation) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.response_id, created=self.created, model=self.model_name,
            choices=[self._choice(c) for c in generation.choices],
            usage=self.usage(generation), metrics=self.metrics(generation))

    def _choice(self, choice: Choice) -> ChatCompletionChoice:
        text, finish_reason = choice.tracker.text, choice.tracker.finish_reason
        message = ChatResponseMessage(content=text)
        if self.tool_calls is not None:
            content, calls, finish_reason = self.tool_calls.message(text, finish_reason)
            message = ChatResponseMessage(content=content, tool_calls=calls)
        return ChatCompletionChoice(index=choice.index, message=message,
                                    logprobs=self._logprobs(choice.tracker.logprobs),
                                    finish_reason=finish_reason)

    def opening_chunks(self, generation: Generation) -> list[ChatCompletionStreamResponse]:
        """Each choice's first chunk carries the role, as OpenAI's do."""
        return [self._chunk([ChatCompletionStreamChoice(
            index=c.index, delta=DeltaMessage(role="assistant", content=""))])
            for c in generation.choices]

    def piece_chunks(self, piece: ChoicePiece,
                     metrics: ResponseMetrics | None) -> list[ChatCompletionStreamResponse]:
        """One chunk a piece; with tools, one more for each call begun or added to, as OpenAI
        sends a call's name and its arguments in chunks of their own. The last chunk carries the
        piece's logprobs and finish reason; a piece whose text is all held back sends nothing
        unless it has those to carry."""
        logprobs = self._logprobs(piece.piece.logprobs) if piece.piece.logprobs else None
        content, finish_reason = piece.piece.text or None, piece.piece.finish_reason
        deltas: list[DeltaMessage] = []
        if self.tool_calls is None:
            deltas.append(DeltaMessage(content=content))
        else:
            stream = self._streams.setdefault(piece.index, ToolCallStream(self.tool_calls))
            new_content, call_deltas, finish_reason = stream.feed(piece.piece.text,
                                                                  finish_reason)
            if new_content:
                deltas.append(DeltaMessage(content=new_content))
            deltas += [DeltaMessage(tool_calls=[delta]) for delta in call_deltas]
            if not deltas and (logprobs or finish_reason is not None or metrics is not None):
                deltas.append(DeltaMessage())
        return [self._chunk([ChatCompletionStreamChoice(
            index=piece.index, delta=delta,
            logprobs=logprobs if is_last else None,
            finish_reason=finish_reason if is_last else None)],
            metrics=metrics if is_last else None)
            for delta, is_last in zip(deltas, [False] * (len(deltas) - 1) + [True])]

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
