"""One completion as its client sees it: token ids, text decoded incrementally, stop strings, and the
text that is safe to stream. Shared by the offline LLM and the HTTP server, so both end a request on a
stop string the same way."""

from __future__ import annotations

from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats


class CompletionTracker:
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
        self.spec_stats: SpecStats | dict | None = None
        # True when a stop string ended it here: the engine does not know and must be told to abort
        self.needs_abort = False
        self._num_streamed_chars = 0

    @property
    def text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None,
              finish_reason: str | None, stop_reason: int | None,
              spec_stats: SpecStats | dict | None = None) -> bool:
        """Fold in one engine delta; True when this completion has just finished."""
        if spec_stats is not None:
            self.spec_stats = spec_stats
        if self.finished:
            return False  # already ended here by a stop string; this is the engine's abort echo
        self.token_ids += new_token_ids
        if self.logprobs is not None and new_logprobs:
            self.logprobs += new_logprobs
        detok = self.detokenizer
        if detok is not None:
            detok.update(new_token_ids)
            if detok.matched_stop is not None:
                self.finish_reason, self.stop_reason = FinishReason.STOP.value, detok.matched_stop
                self.needs_abort = finish_reason is None
                return True
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
            return True
        return False

    def take_stream_text(self) -> str:
        """Text not streamed yet that no stop string can still claim (all of it once finished)."""
        if self.detokenizer is None:
            return ""
        end = len(self.text) if self.finished else self.detokenizer.num_stable_chars
        if end <= self._num_streamed_chars:
            return ""
        piece = self.text[self._num_streamed_chars:end]
        self._num_streamed_chars = end
        return piece
