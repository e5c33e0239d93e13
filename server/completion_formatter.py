"""/v1/completions responses and stream chunks, from a Generation's choices and pieces."""

from __future__ import annotations

from typing import Any

from engine.request import TokenLogprobs
from server.api_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    ResponseMetrics,
)
from server.generation import ChoicePiece, Generation
from server.response_formatter import ResponseFormatter


class CompletionFormatter(ResponseFormatter):
    def __init__(self, tokenizer: Any, model_name: str, echo: list[str], n: int) -> None:
        """echo: per prompt, the text that opens each of its choices ("" without echo)."""
        super().__init__(tokenizer, model_name, "cmpl")
        self.echo = echo
        self.n = n
        # per choice, the text_offset its next streamed token gets
        self._text_offsets: dict[int, int] = {}

    def response(self, generation: Generation) -> CompletionResponse:
        return CompletionResponse(
            id=self.response_id, created=self.created, model=self.model_name,
            choices=[CompletionChoice(
                index=c.index, text=self.echo[c.index // self.n] + c.tracker.text,
                logprobs=self._logprobs(c.tracker.logprobs, 0), finish_reason=c.tracker.finish_reason)
                for c in generation.choices],
            usage=self.usage(generation), metrics=self.metrics(generation))

    def opening_chunks(self, generation: Generation) -> list[CompletionStreamResponse]:
        """The echoed prompt of each choice, if asked for."""
        return [self._chunk([CompletionChoice(index=c.index, text=self.echo[c.index // self.n])])
                for c in generation.choices if self.echo[c.index // self.n]]

    def piece_chunks(self, piece: ChoicePiece,
                     metrics: ResponseMetrics | None) -> list[CompletionStreamResponse]:
        logprobs = None
        if piece.piece.logprobs:
            logprobs = self._logprobs(piece.piece.logprobs, self._text_offsets.get(piece.index, 0))
            self._text_offsets[piece.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return [self._chunk([CompletionChoice(
            index=piece.index, text=piece.piece.text, logprobs=logprobs,
            finish_reason=piece.piece.finish_reason)], metrics=metrics)]

    def usage_chunk(self, generation: Generation) -> CompletionStreamResponse:
        return self._chunk([], usage=self.usage(generation), metrics=self.metrics(generation))

    def _chunk(self, choices: list[CompletionChoice], **extra: Any) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.response_id, created=self.created,
                                        model=self.model_name, choices=choices, **extra)

    def _logprobs(self, logprobs: list[TokenLogprobs] | None,
                  offset: int) -> CompletionLogprobs | None:
        """OpenAI's parallel lists; text_offset counts each token's text from `offset`, where
        these tokens start (tokens as decoded alone, as `tokens` shows them)."""
        if logprobs is None:
            return None
        out = CompletionLogprobs()
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(token)
        return out
