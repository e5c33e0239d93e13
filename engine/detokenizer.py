"""Token ids -> text as they arrive, without splitting a multi-byte character, plus stop-string matching.

Decoding a token alone loses the leading space of sentencepiece pieces and splits UTF-8 characters that
span several byte-level tokens, so each token decodes a short window and emits only the text that grew
and does not end in the replacement character U+FFFD.

Tokens are taken one at a time, even when a speculative step delivers several: the token that completes
a stop string is the last one taken, exactly as when decoding one token per step.
"""

from __future__ import annotations

from typing import Any

# prompt tokens kept as left context so the first output token decodes with its proper spacing
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self._max_stop_chars = max((len(s) for s in stop), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        # the stop string that ended the text, if one did (the text stops just before it)
        self.matched_stop: str | None = None
        # output tokens taken so far; none are taken after the one that completed a stop string
        self.num_tokens = 0
        # per taken token whose text is complete: len(text) once it was. A token that ends inside a
        # character (or decodes to nothing) is complete when a later token completes the text.
        # Non-decreasing, so the tokens behind a prefix of the text are found by bisection.
        self.token_text_ends: list[int] = []

    def update(self, new_token_ids: list[int]) -> str:
        """Take tokens until one completes a stop string; returns the text they add (after any
        stop-string truncation). `num_tokens` tells how many were taken."""
        start_len = len(self.text)
        for token_id in new_token_ids:
            if self.matched_stop is not None:
                break
            self._take(token_id)
        return self.text[start_len:]

    def _take(self, token_id: int) -> None:
        self._ids.append(token_id)
        self.num_tokens += 1
        piece = self._decode_next()
        if not piece:
            return
        piece_start = len(self.text)
        self.text += piece
        num_incomplete = self.num_tokens - len(self.token_text_ends)
        self.token_text_ends += [len(self.text)] * num_incomplete
        self._truncate_at_stop(piece_start)

    def _decode_next(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence (or a skipped special token): wait for more
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

    def _truncate_at_stop(self, piece_start: int) -> None:
        if not self.stop:
            return
        # only a match that ends in the new piece can be new; look back by the longest stop string
        search_from = max(0, piece_start - self._max_stop_chars + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            self.matched_stop = stop

    @property
    def num_stable_chars(self) -> int:
        """Characters safe to stream: a stop string could still start in the held-back tail."""
        if self.matched_stop is not None or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self._max_stop_chars + 1)
