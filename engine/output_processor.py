"""One completion as its client sees it: token ids, text decoded incrementally, stop strings, and the
pieces that are safe to stream. Shared by the offline LLM and the HTTP server, so both end a request on
a stop string the same way.

A speculative step can deliver several tokens at once; the completion keeps exactly the tokens up to
the one that completes a stop string (their ids, logprobs and count), as decoding one token per step
would. A streamed piece carries the text that no stop string can still claim and the logprobs of the
tokens whose text it completes, so the pieces add up to the whole completion, token for token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason, TokenLogprobs
from engine.request_report import ReportCarrier, RequestReport
from engine.sampling_params import SamplingParams
from engine.step.types import RequestUpdate


@dataclass
class StreamPiece:
    """What one completion adds to a stream since its last piece."""

    text: str
    # the tokens whose text this piece completes (all that are left once finished)
    token_ids: list[int]
    # their target logprobs; None when the request did not ask for logprobs
    logprobs: list[TokenLogprobs] | None
    # set on the completion's last piece, and on no other
    finish_reason: str | None = None

    @property
    def is_empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None


class CompletionTracker(ReportCarrier):
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this model folder has none")
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        # the stop token id or stop string that ended it, if one did
        self.stop_reason: int | str | None = None
        # what the engine reports of the request (known once it finishes)
        self.report: RequestReport | None = None
        # True when a stop string ended it here: the engine does not know and must be told to abort
        self.needs_abort = False
        self._num_streamed_chars = 0
        self._num_streamed_tokens = 0
        self._is_finish_streamed = False

    @property
    def text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, update: RequestUpdate) -> bool:
        """Fold in one engine update (the server's and the offline LLM's alike); True when this
        completion has just finished."""
        new_token_ids, new_logprobs = update.new_token_ids, update.new_logprobs
        finish_reason = (None if update.finish_reason is None
                         else FinishReason(update.finish_reason).value)
        if update.report is not None:
            self.report = update.report
        if self.finished:
            return False  # already ended here by a stop string; this is the engine's abort echo
        num_taken = len(new_token_ids)
        detok = self.detokenizer
        if detok is not None:
            detok.update(new_token_ids)
            num_taken = detok.num_tokens - len(self.token_ids)
        self.token_ids += new_token_ids[:num_taken]
        if self.logprobs is not None and new_logprobs:
            self.logprobs += new_logprobs[:num_taken]
        if detok is not None and detok.matched_stop is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP.value, detok.matched_stop
            self.needs_abort = finish_reason is None
            return True
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, update.stop_reason
            return True
        return False

    def take_abort(self) -> bool:
        """Whether the engine must now be told to abort this request (a stop string ended it here,
        and the engine does not know); True once."""
        needs_abort, self.needs_abort = self.needs_abort, False
        return needs_abort

    def take_stream_piece(self) -> StreamPiece:
        """Text not streamed yet that no stop string can still claim, with the tokens it completes
        (everything left once finished)."""
        if self.detokenizer is None or self.finished:
            text_end, token_end = len(self.text), len(self.token_ids)
        else:
            text_end = self.detokenizer.num_stable_chars
            token_end = bisect.bisect_right(self.detokenizer.token_text_ends, text_end)
        text = self.text[self._num_streamed_chars:text_end]
        token_start = self._num_streamed_tokens
        self._num_streamed_chars = max(self._num_streamed_chars, text_end)
        self._num_streamed_tokens = max(token_start, token_end)
        finish_reason = None
        if self.finished and not self._is_finish_streamed:
            self._is_finish_streamed = True
            finish_reason = self.finish_reason
        return StreamPiece(
            text, self.token_ids[token_start:token_end],
            None if self.logprobs is None else self.logprobs[token_start:token_end], finish_reason)
