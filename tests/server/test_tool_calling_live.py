"""Function calling with the real `openai` SDK against a live `specserve serve` on the embedded
model, with its default speculation: required, named, none and auto calls, streamed deltas put back
together, a two-turn loop (call, result, answer), greedy output identical with speculation off, and
the 400s that name their field."""

from __future__ import annotations

import json

import openai
import pytest
from live_server import LiveServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
PARIS_CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
# greedy SmolLM2 calls again after a failed result (recorded: tests/helpers/tool_call_outputs.py)
RETRY = [*ASK, PARIS_CALL, {"role": "tool", "tool_call_id": "call_1",
                            "content": "error: city not found, try again"}]
# ... and writes a block that is not JSON after a whole exchange and a new question
BROKEN = [*ASK, PARIS_CALL,
          {"role": "tool", "tool_call_id": "call_1",
           "content": '{"city": "Paris", "sky": "sunny", "celsius": 21}'},
          {"role": "assistant", "content": "It is sunny in Paris, 21 °C."},
          {"role": "user", "content": "What's the weather in Rome?"}]
NO_SPECULATION = {"speculative_decoding": {"enabled": False}}


@pytest.fixture(scope="module")
def client(embedded_server: LiveServer):
    """`specserve serve` as README starts it, shared with the other modules that need it."""
    return openai.OpenAI(base_url=embedded_server.api, api_key="unused", max_retries=0,
                         timeout=120)


def ask(client, messages=ASK, **kw):
    """RETRY and BROKEN were recorded with the weather tool alone."""
    kw.setdefault("max_tokens", 60)
    kw.setdefault("tools", TOOLS if messages is ASK else [WEATHER])
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_required_makes_a_valid_call(client) -> None:
    response = ask(client, tool_choice="required", parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (name, arguments), = calls_of(choice.message)
    assert name in ("get_weather", "get_time") and isinstance(arguments["city"], str)
    assert choice.message.tool_calls[0].id.startswith("call_")


@pytest.mark.slow
def test_required_with_parallel_calls_may_make_several(client) -> None:
    response = ask(client, tool_choice="required", max_tokens=100)
    message = response.choices[0].message
    assert len(message.tool_calls) >= 2  # greedy SmolLM2 repeats the block
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


@pytest.mark.slow
def test_named_function_is_the_one_called(client) -> None:
    response = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [name for name, _ in calls_of(response.choices[0].message)] == ["get_time"]
    assert response.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_none_answers_in_words_without_seeing_the_tools(client) -> None:
    response = ask(client, tool_choice="none")
    with_tools = ask(client, tool_choice="auto", max_tokens=1)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content
    assert response.usage.prompt_tokens < with_tools.usage.prompt_tokens


@pytest.mark.slow
def test_auto_call_is_parsed_from_the_text(client) -> None:
    response = ask(client, RETRY)
    assert calls_of(response.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert response.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_auto_output_that_is_no_call_comes_back_as_content(client) -> None:
    response = ask(client, BROKEN)
    message = response.choices[0].message
    assert message.tool_calls is None and message.content.startswith("<tool_call>")
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("messages, kw", [
    (ASK, {"tool_choice": "required", "parallel_tool_calls": False}),
    (ASK, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    (RETRY, {}),
])
def test_streamed_deltas_add_up_to_the_response(client, messages, kw) -> None:
    whole = ask(client, messages, **kw).choices[0]
    stream = ask(client, messages, stream=True, **kw)
    calls: dict[int, list] = {}
    argument_chunks, finish_reason, content = 0, None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:  # a call's first chunk: id, type and name, no arguments
                assert delta.index == len(calls) and delta.function.arguments == ""
                assert delta.type == "function"
                calls[delta.index] = [delta.function.name, ""]
            else:
                calls[delta.index][1] += delta.function.arguments
                argument_chunks += 1
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] \
        == calls_of(whole.message)
    assert [arguments for _, arguments in calls.values()] \
        == [c.function.arguments for c in whole.message.tool_calls]
    assert finish_reason == whole.finish_reason == "tool_calls" and content == ""
    if kw:  # grammar-enforced calls stream their arguments as they are written
        assert argument_chunks >= 2


@pytest.mark.slow
def test_two_turn_loop_call_result_answer(client) -> None:
    first = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})}]
    answer = ask(client, history, tool_choice="none", max_tokens=40).choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("messages, kw", [
    (ASK, {"tool_choice": "required", "max_tokens": 100}),
    (ASK, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    (RETRY, {}),
    (BROKEN, {}),
])
def test_greedy_output_is_identical_without_speculation(client, messages, kw) -> None:
    raw = client.chat.completions.with_raw_response
    spec = raw.create(model=MODEL, messages=messages, temperature=0, **{
        "max_tokens": 60, "tools": TOOLS if messages is ASK else [WEATHER], **kw})
    plain = ask(client, messages, extra_body=NO_SPECULATION, **kw)
    spec_message = spec.parse().choices[0].message
    assert calls_of(spec_message) == calls_of(plain.choices[0].message)
    assert [c.function.arguments for c in spec_message.tool_calls or ()] \
        == [c.function.arguments for c in plain.choices[0].message.tool_calls or ()]
    assert spec_message.content == plain.choices[0].message.content
    assert json.loads(spec.text)["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


@pytest.mark.parametrize("kw, messages, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, ASK, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "tag", "parameters": {"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": True}}}}}]}, ASK,
     "tools[0].function.parameters", "cannot be enforced"),
    ({}, [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages",
     "answers no call"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, ASK,
     "response_format", "cannot be combined"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(client, kw, messages, param, words) -> None:
    kw = {"tools": TOOLS, **kw}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **kw)
    assert caught.value.body["param"] == param and words in caught.value.body["message"]
