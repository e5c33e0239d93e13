"""Anthropic's Messages API with the real `anthropic` SDK against a live `specserve serve` on the
embedded model, with its default speculation: text and its stream, a forced tool call answered by
a tool result, token counting, stop sequences, Anthropic-sized max_tokens, Claude Code's extra
fields, greedy output identical with speculation off, errors in Anthropic's shape, and x-api-key.

NOTE: SDK 2.x takes no sampling fields (temperature, top_k) as arguments: they go in extra_body,
as specserve's `speculative_decoding` does."""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import pytest
from live_server import LiveServer

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}
NO_SPECULATION = {**GREEDY, "speculative_decoding": {"enabled": False}}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}
FORCED = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
# greedy SmolLM2 calls again, in its own words, after a failed result (no grammar)
RETRY = [*ASK, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                       "content": "error: city not found, try again"}]}]
KEY = "sk-messages-test"


@pytest.fixture(scope="module")
def client(embedded_server: LiveServer) -> anthropic.Anthropic:
    """`specserve serve` as README starts it, shared with the other modules that need it."""
    return anthropic.Anthropic(base_url=embedded_server.url, api_key="unused", max_retries=0,
                               timeout=120)


def create(client, messages=CAPITAL, extra=GREEDY, **kw):
    kw.setdefault("max_tokens", 24)
    return client.messages.create(model=MODEL, messages=messages, extra_body=extra, **kw)


def stream_final(client, messages=CAPITAL, extra=GREEDY, **kw):
    """The SDK's message put together from the stream, and the events it came in."""
    kw.setdefault("max_tokens", 24)
    with client.messages.stream(model=MODEL, messages=messages, extra_body=extra,
                                **kw) as stream:
        events = list(stream)
        return stream.get_final_message(), events


def said(message) -> list[tuple]:
    """A message's blocks without their ids: (type, text) or (type, name, input)."""
    return [("text", b.text) if b.type == "text" else (b.type, b.name, b.input)
            for b in message.content]


def num_prompt_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


@pytest.mark.promise("api-contract-sdk")
def test_a_text_message_and_its_stream_say_the_same(client) -> None:
    raw = client.messages.with_raw_response.create(model=MODEL, messages=CAPITAL, max_tokens=24,
                                                   extra_body=GREEDY)
    whole = raw.parse()
    assert whole.id.startswith("msg_") and (whole.type, whole.role) == ("message", "assistant")
    assert whole.model == MODEL and whole.stop_reason == "end_turn"
    ((kind, text),) = said(whole)
    assert kind == "text" and "Paris" in text
    assert whole.usage.output_tokens > 0 and whole.usage.cache_creation_input_tokens == 0
    metrics = json.loads(raw.http_response.text)["metrics"]["speculative_decoding"]
    assert metrics["num_spec_tokens"] > 0
    counted = client.messages.count_tokens(model=MODEL, messages=CAPITAL)
    assert num_prompt_tokens(whole) == counted.input_tokens

    streamed, events = stream_final(client)
    assert said(streamed) == said(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert num_prompt_tokens(streamed) == counted.input_tokens
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text


@pytest.mark.promise("api-contract-sdk")
def test_a_forced_tool_call_its_result_and_the_answer(client) -> None:
    first = create(client, ASK, tools=[WEATHER], tool_choice=FORCED, max_tokens=40)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input["city"], str)
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    answer = create(client, history, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=30)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text


@pytest.mark.promise("api-contract-sdk")
def test_count_tokens_counts_the_tools(client) -> None:
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER],
                                              tool_choice={"type": "any"}).input_tokens
    hidden = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER],
                                          tool_choice={"type": "none"}).input_tokens
    assert 0 < plain == hidden < with_tools


@pytest.mark.promise("api-contract-sdk")
@pytest.mark.parametrize("kw, error, error_type, field", [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    ]}]}, anthropic.BadRequestError, "invalid_request_error", "messages.0.content.1.type"),
    ({"messages": [*ASK, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     anthropic.BadRequestError, "invalid_request_error", "messages.1.content.0.tool_use_id"),
    ({"extra_body": {"temperature": 1.5}}, anthropic.BadRequestError, "invalid_request_error",
     "temperature"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, anthropic.BadRequestError,
     "invalid_request_error", "tools.0.input_schema"),
    # refused by the grammar check down the chat road: named as this request names it
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"},
                {"name": "tag", "input_schema": {"type": "object", "properties": {
                    "tags": {"type": "array", "uniqueItems": True}}}}],
      "tool_choice": {"type": "any"}}, anthropic.BadRequestError, "invalid_request_error",
     "tools.1.input_schema cannot be enforced"),
    ({"model": "claude-unknown"}, anthropic.NotFoundError, "not_found_error", "model"),
    ({"extra_body": {"output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}}},
     anthropic.BadRequestError, "invalid_request_error", "output_config.format"),
], ids=["image", "orphan_tool_result", "temperature", "tool_schema", "unenforceable_schema",
        "unknown_model", "unenforceable_output_format"])
def test_bad_requests_get_anthropic_errors_naming_the_field(client, kw, error, error_type,
                                                            field) -> None:
    kw = {"model": MODEL, "max_tokens": 5, "messages": CAPITAL, **kw}
    with pytest.raises(error) as caught:
        client.messages.create(**kw)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == error_type
    assert field in caught.value.body["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_output_config_format_gives_json_of_that_schema(client, stream) -> None:
    """Anthropic's structured output runs as chat's response_format: a grammar at every position,
    drafts included, so the answer parses and validates whatever the small model would say."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    extra = {**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    kw = {"messages": CAPITAL, "extra": extra, "max_tokens": 60}
    message = stream_final(client, **kw)[0] if stream else create(client, **kw)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.slow
def test_a_prompt_past_the_context_is_refused_in_anthropic_words(client) -> None:
    """Claude Code compacts its conversation on this message, as it does with Anthropic's."""
    too_long = [{"role": "user", "content": "hello " * 1500}]
    for call in (lambda: create(client, too_long, max_tokens=5),
                 lambda: client.messages.count_tokens(model=MODEL, messages=too_long)):
        with pytest.raises(anthropic.BadRequestError) as caught:
            call()
        assert re.fullmatch(r"prompt is too long: \d+ tokens > 1023 maximum",
                            caught.value.body["error"]["message"]), caught.value.body


@pytest.mark.slow
@pytest.mark.parametrize("messages, kw", [
    (CAPITAL, {}),
    (ASK, {"tools": [WEATHER], "tool_choice": FORCED, "max_tokens": 40}),
    (RETRY, {"tools": [WEATHER], "max_tokens": 40}),
], ids=["text", "forced_call", "auto_call"])
def test_greedy_output_is_identical_without_speculation(client, messages, kw) -> None:
    raw = client.messages.with_raw_response.create(
        model=MODEL, messages=messages, extra_body=GREEDY, **{"max_tokens": 24, **kw})
    speculating = raw.parse()
    plain = create(client, messages, NO_SPECULATION, **kw)
    assert said(speculating) == said(plain) and speculating.stop_reason == plain.stop_reason
    if "tool_choice" in kw:  # a grammar-enforced call: long and regular, drafts get verified
        assert json.loads(raw.http_response.text)["metrics"]["speculative_decoding"][
            "num_spec_steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("messages, kw, stop_reason", [
    (ASK, {"tools": [WEATHER], "tool_choice": FORCED, "max_tokens": 40}, "tool_use"),
    (ASK, {"tools": [WEATHER], "tool_choice": {"type": "any"}, "max_tokens": 40},
     "max_tokens"),  # greedy SmolLM2 begins a second call, cut by max_tokens
    (RETRY, {"tools": [WEATHER], "max_tokens": 40}, "tool_use"),
], ids=["named", "any", "auto"])
def test_a_streamed_tool_call_equals_the_non_streamed_one(client, messages, kw,
                                                          stop_reason) -> None:
    whole = create(client, messages, **kw)
    streamed, events = stream_final(client, messages, **kw)
    assert said(streamed) == said(whole) and streamed.stop_reason == whole.stop_reason == stop_reason
    assert whole.content[0].input == {"city": "Paris"}
    json_deltas = [e for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
    assert json_deltas and all(e.index == 0 for e in json_deltas)
    if "tool_choice" in kw:  # grammar-enforced calls stream their input as it is written
        assert len(json_deltas) >= 2


@pytest.mark.slow
def test_a_stop_sequence_ends_the_message_and_is_named(client) -> None:
    whole = create(client, stop_sequences=["Paris", "Berlin"])
    streamed, _ = stream_final(client, stop_sequences=["Paris", "Berlin"])
    for message in (whole, streamed):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")
        ((_, text),) = said(message)
        assert "Paris" not in text and text.startswith("The capital of France")


@pytest.mark.slow
def test_anthropic_sized_max_tokens_is_cut_to_the_room_left(client) -> None:
    """Anthropic's clients send 32000 whatever the model; this context holds 1024 tokens."""
    message = create(client, max_tokens=32000)
    assert message.stop_reason == "end_turn" and "Paris" in message.content[0].text


@pytest.mark.slow
def test_system_blocks_and_claude_code_fields(client) -> None:
    """Claude Code's request: the beta path (?beta=true, anthropic-beta), system as blocks with
    cache_control, thinking, context_management, output_config and metadata: all accepted, and
    the answer is the one the plain request gets."""
    pirate = "You are a pirate. Answer in one short sentence."
    plain = create(client, [{"role": "user", "content": "Say hi"}], system=pirate)
    beta = client.beta.messages.create(
        model=MODEL, max_tokens=24, betas=["context-management-2025-06-27"],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}}]}],
        system=[{"type": "text", "text": pirate, "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "user-1"},
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
        output_config={"effort": "low"},
        extra_body=GREEDY, extra_headers={"anthropic-version": "2023-06-01"})
    assert [b.text for b in beta.content] == [b.text for b in plain.content]
    assert beta.stop_reason == plain.stop_reason


@pytest.fixture(scope="module")
def keyed_server():
    """A server of its own that asks for an API key."""
    with LiveServer(["--max-model-len", "1024", "--api-key", KEY]) as server:
        yield server


@pytest.mark.slow
def test_x_api_key_and_bearer_both_authenticate(keyed_server) -> None:
    def client_with(**auth):
        return anthropic.Anthropic(base_url=keyed_server.url, max_retries=0, timeout=120, **auth)

    for good in (client_with(api_key=KEY), client_with(auth_token=KEY)):  # x-api-key, Bearer
        message = good.messages.create(model=MODEL, max_tokens=2, messages=CAPITAL)
        assert message.usage.output_tokens > 0
        assert good.messages.count_tokens(model=MODEL, messages=CAPITAL).input_tokens > 0
    bad = client_with(api_key="wrong")
    for call in (lambda: bad.messages.create(model=MODEL, max_tokens=2, messages=CAPITAL),
                 lambda: bad.messages.count_tokens(model=MODEL, messages=CAPITAL)):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            call()
        assert caught.value.body["error"]["type"] == "authentication_error"
