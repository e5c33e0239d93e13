"""server/api_requests.py: requests fail with errors naming the field, refuse what specserve does not
implement unless neutral, and map onto SamplingParams, penalties, logit_bias and min_p included
(responses: test_api_responses.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from engine.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.errors import ErrorResponse

USER_HI = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER_HI, **fields})


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


@pytest.mark.parametrize("fields, expected", [
    ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
    ({"frequency_penalty": -1}, {"frequency_penalty": -1.0}),
    ({"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
    ({"min_p": 0.05}, {"min_p": 0.05}),
    ({"logit_bias": {"50256": -100, "7": 2.5}}, {"logit_bias": ((7, 2.5), (50256, -100.0))}),
    ({"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 100, "min_p": 1},
     {"presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 100.0,
      "min_p": 1.0}),
])
def test_penalties_logit_bias_and_min_p_reach_sampling_params(fields: dict[str, Any],
                                                              expected: dict[str, Any]) -> None:
    for build in (completion, chat):
        params = build(**fields).to_sampling_params(64)
        for name, value in expected.items():
            assert getattr(params, name) == value, name


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1000}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"1" * 11: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
])
def test_bad_penalty_or_logit_bias_is_named(fields: dict[str, Any], param: str) -> None:
    for build in (completion, chat):
        with pytest.raises(ValidationError) as caught:
            build(**fields)
        assert ErrorResponse.from_validation_errors(caught.value.errors()).error.param == param


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
])
def test_unimplemented_fields_are_refused_unless_neutral(build, name: str, value: Any) -> None:
    with pytest.raises(ValidationError, match="not supported by specserve yet") as caught:
        build(**{name: value})
    assert caught.value.errors()[0]["loc"] == (name,)


@pytest.mark.parametrize("build, fields", [
    (completion, {"best_of": 1, "suffix": ""}),
    (completion, {"best_of": 3, "n": 3, "suffix": None}),
    (chat, {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}),
    (chat, {"tool_choice": "none", "functions": None, "function_call": "none"}),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(build, fields: dict[str, Any]) -> None:
    build(**fields)


@pytest.mark.parametrize("build", [chat, completion])
def test_response_format_reaches_sampling_params_as_its_key(build) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = build(response_format={"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": schema}})
    key = request.to_sampling_params(64).response_format
    assert json.loads(key) == {"type": "json_schema", "schema": schema}
    assert build(response_format={"type": "text"}).to_sampling_params(64).response_format is None


@pytest.mark.parametrize("value, message", [
    ({"type": "xml"}, "type"),
    ({"type": "json_schema"}, "json_schema"),
])
def test_bad_response_formats_are_refused_naming_the_field(value, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        chat(response_format=value)
    assert caught.value.errors()[0]["loc"] == ("response_format",)


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
