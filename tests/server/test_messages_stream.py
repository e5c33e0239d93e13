"""Anthropic's streamed events, read by the real `anthropic` SDK without a server: for scripted
generations (text, a tool call written in pieces, a stop sequence, nothing at all), what
`messages.stream(...).get_final_message()` puts together equals the non-streamed Message, and a
failure midway reaches the client as an `error` event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import anthropic
import pytest

from engine.output_processor import StreamPiece
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats
from server.errors import ApiError
from server.messages_serving import MessagesServing
from server.openai_serving import PreparedChat
from server.tools.call_reader import ToolCallReader
from server.tools.hermes import HermesParser

try:  # the HTTP package the SDK is built on: httpx2 since anthropic 2.x
    import httpx2 as sdk_http
except ImportError:
    import httpx as sdk_http

MODEL = "scripted"
WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedGeneration:
    """A Generation whose pieces are given: (text, finish reason) each."""

    def __init__(self, pieces: list[tuple[str, str | None]], stop_reason: str | None,
                 error: ApiError | None) -> None:
        self.script = pieces
        self.error = error
        tracker = SimpleNamespace(text="".join(text for text, _ in pieces),
                                  finish_reason=pieces[-1][1], stop_reason=stop_reason)
        self.choices = [SimpleNamespace(index=0, tracker=tracker)]
        self.num_prompt_tokens, self.num_cached_tokens = 12, 4
        self.num_completion_tokens, self.num_spec_tokens = len(pieces), 0
        self.is_closed = False

    async def pieces(self) -> AsyncIterator[SimpleNamespace]:
        for text, finish_reason in self.script:
            yield SimpleNamespace(index=0, piece=StreamPiece(text, [], None, finish_reason))
        if self.error is not None:
            raise self.error

    async def run_to_end(self, _) -> None:
        if self.error is not None:
            raise self.error

    def spec_stats(self) -> SpecStats:
        return SpecStats()

    def reports(self) -> list:
        return []

    def close(self) -> None:
        self.is_closed = True


class ScriptedServing:
    """OpenAIServing's `prepare_chat` and `start`, answering with one scripted generation."""

    def __init__(self, pieces, stop_reason=None, error=None) -> None:
        self.generation_args = (pieces, stop_reason, error)
        self.generations: list[ScriptedGeneration] = []

    async def prepare_chat(self, chat, clamp_max_tokens: bool = False) -> PreparedChat:
        reader = None if chat.tools is None else ToolCallReader(
            HermesParser(), forced=False, tool_names=frozenset(f.name for f in chat.tools))
        return PreparedChat([1] * 12, SamplingParams(), reader)

    async def start(self, prepared, chat, tenant) -> ScriptedGeneration:
        self.generations.append(ScriptedGeneration(*self.generation_args))
        return self.generations[-1]


def sdk_client(serving: ScriptedServing) -> anthropic.Anthropic:
    """The SDK, its HTTP answered in-process by MessagesServing over `serving`."""
    async def answer(body: dict) -> sdk_http.Response:
        result = await MessagesServing(serving).create(body, lambda: False)
        if isinstance(result, AsyncIterator):
            events = "".join([event async for event in result])
            return sdk_http.Response(200, content=events.encode(),
                                  headers={"content-type": "text/event-stream"})
        return sdk_http.Response(200, json=result.model_dump(mode="json"))

    transport = sdk_http.MockTransport(lambda request: asyncio.run(answer(json.loads(request.content))))
    return anthropic.Anthropic(api_key="unused", base_url="http://scripted", max_retries=0,
                               http_client=sdk_http.Client(transport=transport))


def comparable(message) -> dict:
    """What a Message says, without its ids (which differ between two answers) and the
    specserve extras (which ride message_delta, not the SDK's accumulated message)."""
    data = message.model_dump(include={"type", "role", "model", "content", "stop_reason",
                                       "stop_sequence", "usage"})
    data["content"] = [{k: v for k, v in block.items() if k in ("type", "text", "name", "input")}
                       for block in data["content"]]
    return data


def in_pieces(text: str, size: int) -> list[tuple[str, None]]:
    return [(text[i:i + size], None) for i in range(0, len(text), size)]


@pytest.mark.parametrize("pieces, stop_reason, tools, expected", [
    ([("Hello", None), (" world", "stop")], None, None,
     ([("text", "Hello world")], "end_turn", None)),
    ([("Hello", None), (" wor", "length")], None, None,
     ([("text", "Hello wor")], "max_tokens", None)),
    ([("The answer is ", "stop")], "END", None,
     ([("text", "The answer is ")], "stop_sequence", "END")),
    ([("", "stop")], None, None, ([], "end_turn", None)),
    ([*in_pieces(f"Let me check.\n{CALL}", 3), ("", "stop")], None, [WEATHER],
     ([("text", "Let me check."), ("tool_use", {"city": "Paris"})], "tool_use", None)),
    ([*in_pieces(CALL + "\n" + CALL, 7), ("", "stop")], None, [WEATHER],
     ([("tool_use", {"city": "Paris"}), ("tool_use", {"city": "Paris"})], "tool_use", None)),
], ids=["text", "max_tokens", "stop_sequence", "nothing", "text_then_call", "two_calls"])
def test_the_stream_adds_up_to_the_message(pieces, stop_reason, tools, expected) -> None:
    client = sdk_client(ScriptedServing(pieces, stop_reason))
    kw = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
          **({"tools": tools} if tools else {})}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert comparable(streamed) == comparable(whole)
    blocks, reason, sequence = expected
    assert [(b.type, b.text if b.type == "text" else b.input) for b in whole.content] == blocks
    assert (whole.stop_reason, whole.stop_sequence) == (reason, sequence)
    assert all(b.id.startswith("toolu_") for b in whole.content if b.type == "tool_use")
    # the prefix cache's share of the prompt is cache_read_input_tokens, as Anthropic counts
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (8, 4)
    assert whole.id.startswith("msg_") and whole.model == MODEL


def test_a_failure_midway_is_an_error_event() -> None:
    serving = ScriptedServing([("Hel", None)], error=ApiError(500, "the engine could not finish "
                                                                   "this request: boom"))
    client = sdk_client(serving)
    with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as stream:
        stream.get_final_message()
    assert caught.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "the engine could not finish this request: boom"}}
    assert serving.generations[0].is_closed
