"""engine/detokenizer.py with the embedded model's real byte-level BPE tokenizer: streamed text
equals a one-shot decode, never shows a broken character, and stops just before a stop string."""

from __future__ import annotations

from typing import Any

import pytest
from embedded_tokenizer import load_embedded_tokenizer

from engine.detokenizer import IncrementalDetokenizer

PROMPT = "Write one sentence:"
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_embedded_tokenizer()


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer: Any, text: str, prompt: str = PROMPT, stop: tuple[str, ...] = (),
           skip_special_tokens: bool = True) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `text`'s tokens one at a time; returns the detokenizer and the piece each step added."""
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), skip_special_tokens, stop)
    pieces = [detok.update([token_id]) for token_id in encode(tokenizer, text)]
    return detok, pieces


# ---------------------------------------------------------------- streaming decode


@pytest.mark.parametrize("text, prompt", [
    ("Hello world, this is a plain ASCII test.", PROMPT),
    ("  leading spaces\n\nand\ttabs ", PROMPT),
    ("naïve café — 日本語 🙂", PROMPT),
    ("🙂🙂 混合 text ✓ ok", PROMPT),
    ("本語です。", "日本語日"),  # the 4-token left context starts inside a character
    ("after the prompt", ""),
])
def test_streaming_equals_one_shot_decode(tokenizer: Any, text: str, prompt: str) -> None:
    token_ids = encode(tokenizer, text)
    detok, pieces = stream(tokenizer, text, prompt)
    assert detok.text == tokenizer.decode(token_ids) == text
    assert "".join(pieces) == detok.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert detok.matched_stop is None


def test_multibyte_characters_wait_for_their_last_byte(tokenizer: Any) -> None:
    text = "日本語 🙂"
    assert len(encode(tokenizer, text)) > len(text)  # some characters span several tokens
    _, pieces = stream(tokenizer, text)
    assert "" in pieces  # a step that completed no character emitted nothing
    assert "".join(pieces) == text


def test_batched_update_equals_one_at_a_time(tokenizer: Any) -> None:
    text = "naïve café — 日本語 🙂 and more"
    token_ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), True)
    added = [detok.update(token_ids[i:i + 3]) for i in range(0, len(token_ids), 3)]
    assert "".join(added) == detok.text == stream(tokenizer, text)[0].text == text


@pytest.mark.parametrize("skip_special_tokens, expected", [
    (True, "Done."),
    (False, f"Done.{IM_END}"),
])
def test_special_tokens(tokenizer: Any, skip_special_tokens: bool, expected: str) -> None:
    detok, _ = stream(tokenizer, f"Done.{IM_END}", skip_special_tokens=skip_special_tokens)
    assert detok.text == expected


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("text, stop, expected_text, matched", [
    ("Hello world, this is a stop test.", ("stop",), "Hello world, this is a ", "stop"),
    ("Hello world, this is a stop test.", ("lo wo",), "Hel", "lo wo"),  # across two tokens
    ("Hello world, this is a stop test.", ("Hello",), "", "Hello"),
    ("Hello world, this is a stop test.", ("test", "this"), "Hello world, ", "this"),
    ("Hello world, this is a stop test.", ("xyz",), "Hello world, this is a stop test.", None),
    ("naïve café — 日本語 🙂", ("本語",), "naïve café — 日", "本語"),
    ("line one\n\nline two", ("\n\n",), "line one", "\n\n"),
])
def test_stop_strings_truncate_before_the_stop(tokenizer: Any, text: str, stop: tuple[str, ...],
                                               expected_text: str, matched: str | None) -> None:
    detok, pieces = stream(tokenizer, text, stop=stop)
    assert detok.text == expected_text
    assert detok.matched_stop == matched
    if matched is not None:
        assert detok.update(encode(tokenizer, " more")) == ""  # nothing after the stop
        assert detok.text == expected_text


def test_stop_split_across_tokens_is_found(tokenizer: Any) -> None:
    text, stop = "Hello world", "lo wo"
    token_ids = encode(tokenizer, text)
    assert not any(stop in tokenizer.decode([t]) for t in token_ids)  # no single token holds it
    assert stream(tokenizer, text, stop=(stop,))[0].text == "Hel"


@pytest.mark.parametrize("stop", [(), ("END",), ("x", "stop here", "!")])
def test_num_stable_chars_holds_back_longest_stop_minus_one(tokenizer: Any,
                                                           stop: tuple[str, ...]) -> None:
    text = "Stream this sentence slowly, token by token."
    held_back = max((len(s) for s in stop), default=1) - 1
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), True, stop)
    for token_id in encode(tokenizer, text):
        detok.update([token_id])
        assert detok.num_stable_chars == max(0, len(detok.text) - held_back)


def test_stable_text_is_never_taken_back(tokenizer: Any) -> None:
    """What was streamed as stable must stay a prefix of the final text, even when a stop
    string begins in the held-back tail."""
    text, stop = "We stream until the marker <<END>> appears.", ("<<END>>",)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), True, stop)
    streamed = ""
    for token_id in encode(tokenizer, text):
        detok.update([token_id])
        stable = detok.text[:detok.num_stable_chars]
        assert stable.startswith(streamed)
        streamed = stable
    assert detok.matched_stop == "<<END>>"
    assert streamed == detok.text == "We stream until the marker "
    assert detok.num_stable_chars == len(detok.text)
