"""How many characters of text can possibly fit a model's context, so an over-long prompt is refused
before it is tokenized (tokenizing a megabyte takes about a second)."""

from __future__ import annotations

from typing import Any

# for a model without a tokenizer (token ids only): no text is tokenized, any bound will do
_NO_TOKENIZER_CHARS_PER_TOKEN = 1


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token can stand for: its longest vocabulary entry. Byte-level BPE
    entries hold one character per byte and SentencePiece entries one per character (a byte
    fallback like `<0x41>` overstates), so a text of c characters needs at least c / this tokens."""
    if tokenizer is None:
        return _NO_TOKENIZER_CHARS_PER_TOKEN
    return max(1, max((len(entry) for entry in tokenizer.get_vocab()), default=1))


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The longest text that could tokenize to fewer than `max_model_len` tokens; a longer one
    cannot fit the context, so it is refused without tokenizing it."""
    return max_model_len * max_chars_per_token(tokenizer)
