"""server/api_responses.py: responses and stream chunks have the shapes the official `openai` SDK
parses, checked with its own types and its own client."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from engine.spec_stats import SpecStats
from server.api_requests import ChatCompletionRequest
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


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER_HI, **fields})


def spec_metrics() -> ResponseMetrics:
    stats = SpecStats()
    stats.observe(num_draft_tokens=3, num_accepted=2, num_emitted=3)
    stats.observe(num_draft_tokens=0, num_accepted=0, num_emitted=1)
    return ResponseMetrics.from_spec_stats(stats, num_spec_tokens=3)


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
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0  # none counted
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


def test_speculation_metrics_are_vllms_payload_exactly() -> None:
    """vLLM PR 48915's example response: 43 verification steps at k = 3, 10 drafts kept; its
    `metrics.speculative_decoding` is what we send for the same counts, key for key."""
    stats = SpecStats()
    for accepted, steps in ((0, 39), (1, 1), (3, 3)):
        for _ in range(steps):
            stats.observe(num_draft_tokens=3, num_accepted=accepted, num_emitted=accepted + 1)
    spec = json.loads(ResponseMetrics.from_spec_stats(stats, num_spec_tokens=3)
                      .model_dump_json())["speculative_decoding"]
    vllm = {"mean_acceptance_length": 1.2325581395348837,
            "draft_acceptance_rate": 0.07751937984496124,
            "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43,
            "num_accepted_draft_tokens": 10, "num_draft_tokens": 129, "num_spec_tokens": 3}
    assert {key: spec[key] for key in vllm} == vllm
    assert all(type(spec[key]) is type(value) for key, value in vllm.items())


def test_a_request_without_speculative_steps_reads_as_nothing_accepted() -> None:
    """Numbers, never null (aiperf drops a payload with a null rate as malformed), and a histogram
    with one bucket per accepted count 0 .. k."""
    stats = SpecStats()
    stats.observe(num_draft_tokens=0, num_accepted=0, num_emitted=1)
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=1, model="m", choices=[],
        metrics=ResponseMetrics.from_spec_stats(stats, num_spec_tokens=4))
    spec = json.loads(chunk.model_dump_json())["metrics"]["speculative_decoding"]
    assert spec["mean_acceptance_length"] == 1.0 and spec["draft_acceptance_rate"] == 0.0
    assert spec["acceptance_histogram"] == [0] * 5 and spec["num_spec_steps"] == 0
    assert spec["num_spec_tokens"] == 4


def test_metrics_carry_every_spec_stats_key() -> None:
    stats = SpecStats()
    stats.observe(num_draft_tokens=4, num_accepted=1, num_emitted=2)
    dumped = ResponseMetrics.from_spec_stats(stats, num_spec_tokens=4).model_dump()
    assert set(stats.as_dict()) <= set(dumped["speculative_decoding"])
    assert dumped["speculative_decoding"]["verify_seconds"] == stats.verify_seconds
    assert dumped["speculative_decoding"]["accepted_per_position"] == [1, 0, 0, 0]


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
