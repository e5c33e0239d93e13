"""A request the engine ended with an error (finish_reason "error", the other requests going on)
reaches its client as OpenAI's error shape: a 500 for a whole response, an error event then
`[DONE]` for a stream, after the tokens it had emitted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import zmq
import zmq.asyncio
from embedded_tokenizer import load_embedded_tokenizer

from engine.engine_args import EngineArgs
from engine.messages import EngineOutputs, EngineReady, encode
from engine.request import FinishReason
from engine.step.types import RequestUpdate
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.engine_client import EngineClient, RequestFailedError
from server.errors import ApiError
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing

WHY = "drafting failed: InjectedFault: the drafter broke"


def test_the_client_hands_over_the_tokens_then_the_error(tiny_llama):
    """EngineClient's router: a final delta with an error becomes its tokens, then
    RequestFailedError, on that request's queue alone."""

    async def main():
        client = EngineClient(EngineArgs(model=tiny_llama))
        address = f"ipc://{client._socket_dir}/output"
        client._from_engine.bind(address)
        engine_side = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        engine_side.connect(address)
        failing, healthy = asyncio.Queue(), asyncio.Queue()
        client._queues.update({"failing": failing, "healthy": healthy})
        router = asyncio.create_task(client._route_outputs())
        try:
            await engine_side.send(encode(EngineOutputs([
                RequestUpdate("failing", [5, 6], finish_reason=FinishReason.ERROR, error=WHY),
                RequestUpdate("healthy", [7])])))
            tokens = await asyncio.wait_for(failing.get(), 10)
            error = await asyncio.wait_for(failing.get(), 10)
            assert tokens.new_token_ids == [5, 6] and tokens.finish_reason is None
            assert isinstance(error, RequestFailedError) and str(error) == WHY
            assert (await asyncio.wait_for(healthy.get(), 10)).new_token_ids == [7]
            assert "failing" not in client._queues and "healthy" in client._queues
        finally:
            router.cancel()
            engine_side.close(linger=0)
            client._context.destroy(linger=0)

    asyncio.run(main())


class FailingEngine:
    """Stands in for EngineClient: each request emits a few tokens, then the engine fails it."""

    def __init__(self, tokenizer: Any) -> None:
        self.ready = EngineReady("tiny", 4096, 49152, "float32", "cpu", 64, 16, "ngram", 4)
        self.is_alive = True
        self.tokens = tokenizer.encode("Hello there", add_special_tokens=False)
        self.aborted: list[str] = []

    async def add_request(self, request_id, prompt_token_ids, params, cache_salt=None):
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RequestUpdate(request_id, self.tokens))
        queue.put_nowait(RequestFailedError(WHY))
        return queue

    def abort_soon(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


async def never_disconnected() -> bool:
    return False


@pytest.fixture(scope="module")
def serving() -> OpenAIServing:
    tokenizer = load_embedded_tokenizer()
    return OpenAIServing(FailingEngine(tokenizer), tokenizer, "tiny",
                         ServerMetrics("tiny", "ngram", 4), max_waiting_requests=8)


def request(endpoint: str, stream: bool) -> CompletionRequest | ChatCompletionRequest:
    fields = {"max_tokens": 16, "stream": stream}
    if endpoint == "completions":
        return CompletionRequest.model_validate({"prompt": "Hi", **fields})
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}],
                                                 **fields})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_failed_request_gets_a_500_in_openai_shape(serving, endpoint):
    body = request(endpoint, stream=False)
    handler = serving.completions if endpoint == "completions" else serving.chat
    with pytest.raises(ApiError) as raised:
        asyncio.run(handler(body, never_disconnected))
    error = raised.value
    assert error.status == 500 and WHY in error.message
    assert serving.client.aborted == []  # the engine ended it already
    finished = serving.metrics.registry.get_sample_value(
        "specserve:request_success_total",
        {"model_name": "tiny", "spec_method": "ngram", "finished_reason": "error"})
    assert finished and finished >= 1
    assert error.body()["error"]["type"] == "InternalServerError"
    assert error.body()["error"]["code"] == "request_failed"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_failed_stream_ends_with_an_error_event_after_its_tokens(serving, endpoint):
    async def events() -> list:
        handler = serving.completions if endpoint == "completions" else serving.chat
        stream = await handler(request(endpoint, stream=True), never_disconnected)
        return [event.removeprefix("data: ").strip() async for event in stream]

    payloads = asyncio.run(events())
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert WHY in error["message"] and error["type"] == "InternalServerError"
    chunks = [json.loads(p) for p in payloads[:-2]]
    text = "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                    or "") for c in chunks if c.get("choices"))
    assert text == "Hello there"
