"""server/api_requests.py and api_responses.py: requests fail with errors naming the field, map onto SamplingParams, and
responses have shapes the official `openai` SDK parses (checked with its own types and client)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from engine.spec_stats import SpecStats
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.api_responses import (
    MIN_LOGPROB,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    ResponseMetrics,
    TopLogprob,
    Usage,
)
from server.errors import ErrorResponse

USER_HI = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER_HI, **fields})


def spec_metrics() -> ResponseMetrics:
    stats = SpecStats()
    stats.observe(num_draft_tokens=3, num_accepted=2, num_emitted=3)
    stats.observe(num_draft_tokens=0, num_accepted=0, num_emitted=1)
    return ResponseMetrics.from_spec_stats(stats)


# ---------------------------------------------------------------- request validation
@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": ""}, "stop.0"),
    ({"stop": ["###", ""]}, "stop.1"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop.1"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"speculative_decoding": {"num_speculative_tokens": -1}},
     "speculative_decoding.num_speculative_tokens"),
    ({"speculative_decoding": {"enabled": "no"}}, "speculative_decoding.enabled"),
    ({"speculative_decoding": {"num_spec_tokens": 2}}, "speculative_decoding.num_spec_tokens"),
])
def test_bad_completion_field_is_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        completion(**fields)
    error = ErrorResponse.from_validation_errors(caught.value.errors()).error
    assert error.param == param
    assert error.message.startswith(f"{param}: ")
    assert param.split(".")[0] in str(caught.value)


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ({"messages": [*USER_HI, {"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}, "messages.1.content"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"),
])
def test_bad_chat_field_is_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        chat(**fields)
    error = ErrorResponse.from_validation_errors(caught.value.errors()).error
    assert error.param == param
    assert error.message.startswith(f"{param}: ")


def test_non_text_content_part_says_what_is_supported() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    with pytest.raises(ValidationError, match=r"'image_url'; only 'text' parts are supported"):
        chat(messages=[{"role": "user", "content": [image]}])


@pytest.mark.parametrize("name, value", [
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1.0),
    ("repetition_penalty", 1.2),
    ("logit_bias", {"50256": -100.0}),
])
def test_output_changing_options_are_unsupported(name: str, value: Any) -> None:
    for build in (completion, chat):
        with pytest.raises(ValidationError, match="not supported by specserve") as caught:
            build(**{name: value})
        assert caught.value.errors()[0]["loc"] == (name,)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}},
    {"presence_penalty": None, "frequency_penalty": None, "logit_bias": None},
])
def test_neutral_penalties_are_accepted(fields: dict[str, Any]) -> None:
    assert completion(**fields).to_sampling_params(64) == SamplingParams(max_tokens=16)


def test_unknown_fields_are_ignored() -> None:
    request = chat(user="alice", metadata={"team": "a"}, store=False, frobnicate=1)
    assert request.user == "alice"
    assert not hasattr(request, "frobnicate")
    assert completion(suffix="", best_of=1).prompt == "hi"


@pytest.mark.parametrize("build, name, value", [
    (completion, "best_of", 2),
    (completion, "suffix", "!"),
    (chat, "response_format", {"type": "json_object"}),
    (chat, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    (chat, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (chat, "tool_choice", "required"),
    (chat, "tool_choice", {"type": "function", "function": {"name": "f"}}),
    (chat, "functions", [{"name": "f"}]),
    (chat, "function_call", {"name": "f"}),
])
def test_unimplemented_fields_are_refused_unless_neutral(build, name: str, value: Any) -> None:
    with pytest.raises(ValidationError, match="not supported by specserve yet") as caught:
        build(**{name: value})
    assert caught.value.errors()[0]["loc"] == (name,)


@pytest.mark.parametrize("build, fields", [
    (completion, {"best_of": 1, "suffix": ""}),
    (completion, {"best_of": 3, "n": 3, "suffix": None}),
    (chat, {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}),
    (chat, {"tool_choice": "auto", "functions": None, "function_call": "none"}),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(build, fields: dict[str, Any]) -> None:
    build(**fields)


def test_json_integers_are_valid_floats() -> None:
    request = CompletionRequest.model_validate_json('{"prompt": "hi", "temperature": 1, "top_p": 1}')
    assert (request.temperature, request.top_p) == (1.0, 1.0)


# ---------------------------------------------------------------- prompts and messages
@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes_become_a_list_of_prompts(prompt: Any, prompts: list[Any]) -> None:
    assert completion(prompt=prompt).prompts == prompts


def test_chat_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.messages[0].content == "first\nsecond"


def test_template_messages_map_developer_to_system() -> None:
    request = chat(messages=[{"role": "developer", "content": "be brief"}, *USER_HI,
                             {"role": "assistant", "content": None}])
    assert request.template_messages() == [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": ""}]


# ---------------------------------------------------------------- mapping onto SamplingParams
def test_completion_fields_map_onto_sampling_params() -> None:
    request = completion(temperature=0, top_p=0.9, top_k=40, n=2, seed=7, stop="###",
                         stop_token_ids=[2], min_tokens=1, ignore_eos=True, max_tokens=32,
                         logprobs=3)
    assert request.to_sampling_params(default_max_tokens=100) == SamplingParams(
        temperature=0.0, top_p=0.9, top_k=40, n=2, seed=7, stop=("###",), stop_token_ids=(2,),
        min_tokens=1, ignore_eos=True, max_tokens=32, logprobs=3)
    assert request.to_sampling_params(100).is_greedy


def test_unset_fields_take_the_engine_defaults() -> None:
    assert completion().to_sampling_params(100) == SamplingParams(max_tokens=16)
    assert chat().to_sampling_params(100) == SamplingParams(max_tokens=100)


@pytest.mark.parametrize("fields, max_tokens", [
    ({}, 500),
    ({"max_tokens": 8}, 8),
    ({"max_completion_tokens": 9}, 9),
    ({"max_tokens": 8, "max_completion_tokens": 9}, 9),
    ({"max_tokens": 8, "max_completion_tokens": None}, 8),
])
def test_chat_max_completion_tokens_beats_max_tokens(fields: dict[str, Any],
                                                     max_tokens: int) -> None:
    assert chat(**fields).to_sampling_params(default_max_tokens=500).max_tokens == max_tokens


def test_completion_null_max_tokens_takes_the_room_left() -> None:
    assert completion(max_tokens=None).to_sampling_params(default_max_tokens=77).max_tokens == 77


@pytest.mark.parametrize("fields, logprobs", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 5}, 5),
    ({"logprobs": True, "top_logprobs": 0}, 0),
])
def test_chat_logprobs_mapping(fields: dict[str, Any], logprobs: int | None) -> None:
    assert chat(**fields).to_sampling_params(10).logprobs == logprobs


@pytest.mark.parametrize("logprobs", [None, 0, 5, MAX_LOGPROBS])
def test_completion_logprobs_mapping(logprobs: int | None) -> None:
    assert completion(logprobs=logprobs).to_sampling_params(10).logprobs == logprobs


@pytest.mark.parametrize("extra, num_speculative_tokens", [
    (None, None),
    ({}, None),
    ({"enabled": True}, None),
    ({"enabled": False}, 0),
    ({"enabled": False, "num_speculative_tokens": 3}, 0),
    ({"num_speculative_tokens": 2}, 2),
    ({"enabled": True, "num_speculative_tokens": 0}, 0),
])
def test_speculative_decoding_extra_maps_to_the_cap(extra: dict[str, Any] | None,
                                                    num_speculative_tokens: int | None) -> None:
    for build in (completion, chat):
        params = build(speculative_decoding=extra).to_sampling_params(10)
        assert params.num_speculative_tokens == num_speculative_tokens


def test_sampling_params_errors_propagate() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        completion(min_tokens=20, max_tokens=4).to_sampling_params(100)


def test_include_usage() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


# ---------------------------------------------------------------- responses through the SDK's types
def test_completion_response_parses_as_sdk_completion() -> None:
    logprobs = CompletionLogprobs(tokens=[" a", " b"], token_logprobs=[-0.1, -float("inf")],
                                  top_logprobs=[{" a": -0.1}, {" c": -0.5}], text_offset=[0, 2])
    response = CompletionResponse(model="m", usage=Usage.count(3, 2), metrics=spec_metrics(),
                                  choices=[CompletionChoice(index=0, text=" a b", logprobs=logprobs,
                                                            finish_reason="length")])
    parsed = Completion.model_validate(response.model_dump())
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.choices[0].logprobs.token_logprobs == [-0.1, MIN_LOGPROB]
    assert parsed.usage.total_tokens == 5
    assert parsed.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] == 3


def test_chat_response_parses_as_sdk_chat_completion() -> None:
    token = ChatTokenLogprob(token="Hi", logprob=-0.2, bytes=[72, 105],
                             top_logprobs=[TopLogprob(token="Hi", logprob=-0.2, bytes=[72, 105])])
    response = ChatCompletionResponse(
        model="m", usage=Usage.count(5, 1),
        choices=[ChatCompletionChoice(index=0, message=ChatResponseMessage(content="Hi"),
                                      logprobs=ChatChoiceLogprobs(content=[token]),
                                      finish_reason="stop")])
    parsed = ChatCompletion.model_validate(response.model_dump())
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 105]
    assert "metrics" not in response.model_dump()


def chat_stream_chunks(include_usage: bool) -> list[ChatCompletionStreamResponse]:
    """A one-choice stream as the app sends it: role, content, finish, then the usage chunk."""
    same = {"id": "chatcmpl-1", "created": 1, "model": "m"}
    token = ChatTokenLogprob(token="Hi", logprob=-0.2, top_logprobs=[])
    chunks = [
        ChatCompletionStreamResponse(**same, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(role="assistant", content=""))]),
        ChatCompletionStreamResponse(**same, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(content="Hi"),
            logprobs=ChatChoiceLogprobs(content=[token]))]),
        ChatCompletionStreamResponse(**same, choices=[ChatCompletionStreamChoice(
            index=0, finish_reason="stop")]),
    ]
    final = ChatCompletionStreamResponse(**same, choices=[], metrics=spec_metrics(),
                                         usage=Usage.count(5, 1) if include_usage else None)
    return [*chunks, final]


def test_chat_chunks_parse_as_sdk_chunks() -> None:
    parsed = [ChatCompletionChunk.model_validate(chunk.model_dump())
              for chunk in chat_stream_chunks(include_usage=True)]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "Hi"
    assert parsed[2].choices[0].finish_reason == "stop"
    assert parsed[3].choices == [] and parsed[3].usage.completion_tokens == 1
    assert parsed[3].model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] == 1


def test_chunks_keep_openai_nulls_and_omit_unset_extras() -> None:
    role, content, finish, final = (chunk.model_dump()
                                    for chunk in chat_stream_chunks(include_usage=False))
    assert role["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
    assert content["choices"][0]["delta"] == {"content": "Hi"}
    assert finish["choices"][0]["delta"] == {}
    assert role["usage"] is None and "metrics" not in role
    assert final["usage"] is None and final["choices"] == []
    assert final["metrics"]["speculative_decoding"]["draft_acceptance_rate"] == pytest.approx(2 / 3)


def test_nulls_inside_metrics_are_kept() -> None:
    # α and τ are null before any draft; the keys stay so clients can rely on them
    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", created=1, model="m", choices=[],
                                         metrics=ResponseMetrics.from_spec_stats(SpecStats()))
    spec = json.loads(chunk.model_dump_json())["metrics"]["speculative_decoding"]
    assert spec["draft_acceptance_rate"] is None and spec["mean_acceptance_length"] is None


def test_metrics_carry_every_spec_stats_key() -> None:
    stats = SpecStats()
    stats.observe(num_draft_tokens=4, num_accepted=1, num_emitted=2)
    dumped = ResponseMetrics.from_spec_stats(stats.as_dict()).model_dump()
    assert dumped["speculative_decoding"] == stats.as_dict()


def test_logprobs_never_serialise_as_infinity() -> None:
    top = TopLogprob(token="x", logprob=-math.inf)
    assert json.loads(top.model_dump_json())["logprob"] == MIN_LOGPROB


# ---------------------------------------------------------------- responses through the SDK's client
def sdk_client(reply: httpx.Response | list[str]) -> openai.OpenAI:
    """An SDK client whose HTTP layer answers with `reply`: a response, or SSE `data:` payloads."""
    def answer(request: httpx.Request) -> httpx.Response:
        if isinstance(reply, httpx.Response):
            return reply
        body = "".join(f"data: {payload}\n\n" for payload in [*reply, "[DONE]"])
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
    transport = httpx.MockTransport(answer)
    return openai.OpenAI(api_key="test", base_url="http://specserve.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=transport))


def test_sdk_reads_a_completion_stream() -> None:
    same = {"id": "cmpl-1", "created": 1, "model": "m"}
    chunks = [
        CompletionStreamResponse(**same, choices=[CompletionChoice(index=0, text="He")]),
        CompletionStreamResponse(**same, choices=[CompletionChoice(index=0, text="llo",
                                                                   finish_reason="stop")]),
        CompletionStreamResponse(**same, choices=[], usage=Usage.count(2, 2),
                                 metrics=spec_metrics()),
    ]
    client = sdk_client([chunk.model_dump_json() for chunk in chunks])
    received = list(client.completions.create(model="m", prompt="hi", stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.text for chunk in received for c in chunk.choices) == "Hello"
    assert received[0].choices[0].finish_reason is None
    assert received[-1].usage.total_tokens == 4
    assert received[-1].model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] == 3


def test_sdk_reads_a_chat_stream() -> None:
    client = sdk_client([chunk.model_dump_json() for chunk in chat_stream_chunks(True)])
    received = list(client.chat.completions.create(model="m", messages=USER_HI, stream=True))
    assert "".join(c.delta.content or "" for chunk in received for c in chunk.choices) == "Hi"
    assert received[-1].usage.prompt_tokens == 5


def test_sdk_reads_the_model_list() -> None:
    models = ModelList(data=[ModelCard(id="smollm2", max_model_len=2048)])
    page = sdk_client(httpx.Response(200, json=models.model_dump())).models.list()
    assert [model.id for model in page] == ["smollm2"]
    card = Model.model_validate(models.data[0].model_dump())
    assert card.owned_by == "specserve" and card.model_extra["max_model_len"] == 2048


def test_sdk_reads_an_error() -> None:
    with pytest.raises(ValidationError) as invalid:
        chat(temperature=5)
    body = ErrorResponse.from_validation_errors(invalid.value.errors()).model_dump()
    client = sdk_client(httpx.Response(400, json=body))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=USER_HI, temperature=5)
    assert caught.value.param == "temperature"
    assert caught.value.type == "invalid_request_error"
    assert "temperature" in caught.value.message


def test_from_validation_errors_strips_fastapi_body_prefix() -> None:
    errors = [{"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user'"},
              {"loc": ("body",), "msg": "JSON decode error"}]
    error = ErrorResponse.from_validation_errors(errors).error
    assert error.param == "messages.0.role"
    assert error.message == "messages.0.role: Input should be 'user'; JSON decode error"
