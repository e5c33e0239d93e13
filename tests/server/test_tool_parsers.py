"""The Hermes and Llama 3.1 parsers on recorded outputs, whole and streamed: a stream's pieces add
up to the whole response's message, however the text is cut."""

from __future__ import annotations

import json
import random

import pytest
from tool_call_outputs import (
    LLAMA31_NAMES,
    LLAMA31_PLAIN,
    LLAMA31_TAGGED,
    QWEN25_NAMES,
    QWEN25_TWO_CALLS,
    SMOLLM2_AUTO_BROKEN,
    SMOLLM2_AUTO_CALL,
    SMOLLM2_NAMES,
    SMOLLM2_REQUIRED_CUT,
)

from server.tools.call_reader import ToolCallReader, ToolCallStream
from server.tools.hermes import HermesParser
from server.tools.llama3_json import Llama3JsonParser

HERMES, LLAMA3 = HermesParser(), Llama3JsonParser()


def whole(parser, text, names, forced=False, finish_reason="stop"):
    content, calls, finish = ToolCallReader(parser, forced, names).message(text, finish_reason)
    return content, [(c.function.name, c.function.arguments) for c in calls or ()], finish


def streamed(parser, text, names, cuts, forced=False, finish_reason="stop"):
    """The message a client rebuilds from the stream's deltas, the text cut at `cuts`."""
    stream = ToolCallStream(ToolCallReader(parser, forced, names))
    bounds = [0, *cuts, len(text)]
    content, calls, finish = "", {}, None
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        is_last = index == len(bounds) - 2
        new, deltas, finish = stream.feed(text[start:end], finish_reason if is_last else None)
        content += new
        for delta in deltas:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.function.arguments == ""
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.function.name is None
                calls[delta.index][1] += delta.function.arguments
    return content or None, [tuple(call) for call in calls.values()], finish


def test_qwen25_parallel_calls() -> None:
    content, calls, finish = whole(HERMES, QWEN25_TWO_CALLS, QWEN25_NAMES)
    assert content is None and finish == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]
    # the arguments are the model's own text, not a re-serialisation
    assert calls[1][1] == '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'


def test_hermes_text_around_a_call_is_content() -> None:
    text = f"Let me check.\n{SMOLLM2_AUTO_CALL}\nOne moment."
    content, calls, _ = whole(HERMES, text, SMOLLM2_NAMES)
    assert content == "Let me check.\n\nOne moment." and calls[0][0] == "get_weather"


@pytest.mark.parametrize("text", [SMOLLM2_AUTO_BROKEN, SMOLLM2_AUTO_CALL])
def test_hermes_block_that_is_no_allowed_call_stays_text(text) -> None:
    names = SMOLLM2_NAMES if text is SMOLLM2_AUTO_BROKEN else frozenset({"other"})
    assert whole(HERMES, text, names) == (text, [], "stop")


def test_hermes_forced_call_cut_by_length_keeps_what_was_written() -> None:
    content, calls, finish = whole(HERMES, SMOLLM2_REQUIRED_CUT, SMOLLM2_NAMES, forced=True,
                                   finish_reason="length")
    assert content is None and finish == "length"
    assert calls == [("get_weather", '{\n    "city": "Paris"\n}'),
                     ("get_weather", '{\n    "city": "Paris"')]


@pytest.mark.parametrize("text", [LLAMA31_TAGGED, LLAMA31_PLAIN])
def test_llama31_call(text) -> None:
    content, calls, finish = whole(LLAMA3, text, LLAMA31_NAMES)
    assert content is None and finish == "tool_calls"
    assert calls == [("get_current_conditions",
                      '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]


def test_llama31_several_calls_joined_by_semicolons() -> None:
    text = f"{LLAMA31_PLAIN}; {LLAMA31_PLAIN.replace('Fahrenheit', 'Celsius')}"
    _, calls, _ = whole(LLAMA3, text, LLAMA31_NAMES)
    assert [json.loads(a)["unit"] for _, a in calls] == ["Fahrenheit", "Celsius"]


@pytest.mark.parametrize("text", ['{"answer": 42}', LLAMA31_PLAIN + " and more", "It is sunny."])
def test_llama31_answer_that_is_no_call_is_content(text) -> None:
    assert whole(LLAMA3, text, LLAMA31_NAMES) == (text, [], "stop")


CASES = [
    (HERMES, QWEN25_TWO_CALLS, QWEN25_NAMES, False, "stop"),
    (HERMES, f"Sure.\n{SMOLLM2_AUTO_CALL}", SMOLLM2_NAMES, False, "stop"),
    (HERMES, SMOLLM2_AUTO_BROKEN, SMOLLM2_NAMES, False, "stop"),
    (HERMES, "Plain text, < and <tool with  spaces  ", SMOLLM2_NAMES, False, "stop"),
    (HERMES, SMOLLM2_REQUIRED_CUT, SMOLLM2_NAMES, True, "length"),
    (HERMES, QWEN25_TWO_CALLS, QWEN25_NAMES, True, "stop"),
    (LLAMA3, LLAMA31_TAGGED, LLAMA31_NAMES, False, "stop"),
    (LLAMA3, f"{LLAMA31_PLAIN}; {LLAMA31_PLAIN}", LLAMA31_NAMES, True, "stop"),
    (LLAMA3, '{"answer": 42}', LLAMA31_NAMES, False, "stop"),
]


@pytest.mark.parametrize("parser, text, names, forced, finish_reason", CASES)
def test_stream_adds_up_to_the_whole_message(parser, text, names, forced, finish_reason) -> None:
    expected = whole(parser, text, names, forced, finish_reason)
    rng = random.Random(0)
    cuttings = [list(range(1, len(text)))]  # a character at a time
    cuttings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, 8))) for _ in range(30)]
    for cuts in cuttings:
        assert streamed(parser, text, names, cuts, forced, finish_reason) == expected, cuts


def test_forced_calls_stream_their_arguments_as_written() -> None:
    stream = ToolCallStream(ToolCallReader(HERMES, True, SMOLLM2_NAMES))
    text = SMOLLM2_AUTO_CALL
    header_at = text.index('"arguments": ') + len('"arguments": ')
    _, deltas, _ = stream.feed(text[:header_at - 3], None)
    assert deltas == []  # the name is not out until its argument key is
    _, deltas, _ = stream.feed(text[header_at - 3:header_at + 5], None)
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("get_weather", ""), (None, '{"cit')]


def test_auto_holds_an_open_block_back() -> None:
    stream = ToolCallStream(ToolCallReader(HERMES, False, SMOLLM2_NAMES))
    assert stream.feed("Checking <tool_", None) == ("Checking", [], None)
    content, deltas, _ = stream.feed(SMOLLM2_AUTO_CALL[len("<tool_"):-3], None)
    assert content == "" and deltas == []
    _, deltas, finish = stream.feed(SMOLLM2_AUTO_CALL[-3:], "stop")
    assert [d.function.name for d in deltas] == ["get_weather", None] and finish == "tool_calls"
