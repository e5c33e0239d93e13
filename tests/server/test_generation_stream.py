"""The HTTP side of a generation against a scripted engine (no model), with the embedded model's real
tokenizer: every choice of a stream ends exactly once with all its tokens however far the reader lags,
streamed logprobs equal the non-streamed ones token for token (stop strings, multi-byte text), a stop
string inside a speculative block keeps exactly the tokens up to it, and no valid body gets a 500."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from embedded_tokenizer import load_embedded_tokenizer

from engine.messages import EngineReady
from engine.request import TokenLogprobs
from engine.step.types import RequestUpdate
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing

MULTIBYTE_TEXT = "naïve café — 日本語 🙂 ok, then STOP here and 🙂 more text after it."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_embedded_tokenizer()


class ScriptedEngine:
    """Stands in for EngineClient. Each request's whole script of deltas lands in its queue at once,
    the moment it is added: the stream's reader is as far behind the engine as it can be."""

    def __init__(self, script) -> None:
        # script(request_index_within_its_prompt) -> the deltas of that choice
        self.script = script
        self.ready = EngineReady("tiny", 4096, 49152, "float32", "cpu", 64, 16, "ngram", 4)
        self.is_alive = True
        self.added: list[tuple[str, Any, str | None]] = []
        self.aborted: list[str] = []

    async def add_request(self, request_id, prompt_token_ids, params, cache_salt=None):
        self.added.append((request_id, params, cache_salt))
        queue: asyncio.Queue = asyncio.Queue()
        for delta in self.script(int(request_id.rsplit("-", 1)[1])):
            queue.put_nowait(RequestUpdate(request_id, **delta))
        return queue

    def abort_soon(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def token_deltas(token_ids: list[int], block_sizes: list[int], finish_reason: str | None = "length",
                 with_logprobs: bool = True) -> list[dict]:
    """The tokens in speculative-sized blocks (sizes cycle), each token with made-up logprobs;
    the last block finishes the request, unless finish_reason is None."""
    deltas, start, i = [], 0, 0
    while start < len(token_ids):
        size = block_sizes[i % len(block_sizes)]
        block = token_ids[start:start + size]
        logprobs = [TokenLogprobs(t, -0.01 * (start + j), 1 + j % 2, [(t, -0.01 * (start + j)),
                                                                     (7, -5.0)])
                    for j, t in enumerate(block)] if with_logprobs else None
        deltas.append({"new_token_ids": block, "new_logprobs": logprobs})
        start, i = start + size, i + 1
    deltas[-1]["finish_reason"] = finish_reason
    return deltas


def serving_for(engine: ScriptedEngine, tokenizer: Any) -> OpenAIServing:
    return OpenAIServing(engine, tokenizer, "tiny", ServerMetrics("tiny", "ngram", 4),
                         max_waiting_requests=64)


async def never_disconnected() -> bool:
    return False


def run(serving: OpenAIServing, body, read_delay: float = 0.0, tenant: str | None = None) -> Any:
    """The response model, or the parsed SSE events of a stream read `read_delay` s per event."""
    async def go():
        handler = serving.chat if isinstance(body, ChatCompletionRequest) else serving.completions
        result = await handler(body, never_disconnected, tenant)
        if not body.stream:
            return result.model_dump(mode="json")
        events = []
        async for event in result:
            await asyncio.sleep(read_delay)  # a slow reader: the engine side races ahead
            payload = event.removeprefix("data: ").strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events
    return asyncio.run(go())


# ---------------------------------------------------------------- n > 1 streams
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_choice_of_a_lagging_stream_ends_once_with_all_its_tokens(tokenizer, endpoint):
    texts = ["One two three four five six seven.", "Alpha beta gamma.", "x y z " * 9 + "end"]
    engine = ScriptedEngine(lambda j: token_deltas(
        tokenizer.encode(texts[j], add_special_tokens=False), [1, 3, 2, 5], with_logprobs=False))
    fields = {"max_tokens": 64, "n": 3, "stream": True}
    body = (CompletionRequest.model_validate({"prompt": [1, 2, 3], **fields}) if endpoint ==
            "completions" else ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": "hi"}], **fields}))
    events = run(serving_for(engine, tokenizer), body, read_delay=0.005)

    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"][0]["finish_reason"] is not None]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    for index, text in enumerate(texts):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        streamed = "".join(c["text"] if endpoint == "completions" else
                           c["delta"].get("content") or "" for c in mine)
        assert streamed == text
        assert mine[-1]["finish_reason"] == "length"  # nothing of a choice after its finish
    assert chunks[-1]["metrics"]["speculative_decoding"]["num_spec_steps"] == 0


# ---------------------------------------------------------------- logprobs and stop strings
def full_and_streamed(tokenizer, endpoint: str, stop: list[str] | None, block_sizes: list[int],
                      text: str = MULTIBYTE_TEXT):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # NOTE: no finish from the engine: a stop string has to end it here, inside a block
    script = (lambda j: token_deltas(token_ids, block_sizes, finish_reason=None if stop else
                                     "length"))
    results = []
    for stream in (False, True):
        fields = {"max_tokens": 200, "stop": stop, "stream": stream}
        if endpoint == "completions":
            body = CompletionRequest.model_validate({"prompt": [1, 2], "logprobs": 2, **fields})
        else:
            body = ChatCompletionRequest.model_validate({
                "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                "top_logprobs": 2, **fields})
        if stream:
            body.stream_options = None
        engine = ScriptedEngine(script)
        results.append((run(serving_for(engine, tokenizer), body, read_delay=0.001), engine))
    return token_ids, results


def streamed_logprobs(endpoint: str, events: list) -> dict | list:
    chunks = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    if endpoint == "chat":
        return [t for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in merged:
            merged[key] += chunk["logprobs"][key] if chunk["logprobs"] else []
    return merged


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stop, block_sizes", [
    (None, [1]),
    (None, [3, 1, 4]),
    (["STOP"], [1]),
    (["STOP"], [5]),
    (["日本語 🙂 ok", "never"], [2, 7]),
])
def test_streamed_logprobs_equal_the_full_response(tokenizer, endpoint, stop, block_sizes):
    _, ((full, _), (events, _)) = full_and_streamed(tokenizer, endpoint, stop, block_sizes)
    choice = full["choices"][0]
    text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
    expected_logprobs = choice["logprobs"] if endpoint == "completions" else \
        choice["logprobs"]["content"]
    assert streamed_logprobs(endpoint, events) == expected_logprobs
    chunks = [e["choices"][0] for e in events if e != "[DONE]"]
    assert "".join((c.get("text") if endpoint == "completions" else c["delta"].get("content"))
                   or "" for c in chunks) == text
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    assert "\ufffd" not in text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("block_sizes", [[1], [4], [9], [2, 5, 3]])
def test_a_stop_string_inside_a_block_keeps_exactly_the_tokens_up_to_it(tokenizer, endpoint,
                                                                       block_sizes):
    token_ids, ((full, engine), (events, _)) = full_and_streamed(tokenizer, endpoint, ["STOP"],
                                                                 block_sizes)
    # the token that completes "STOP": the first whose decoded prefix contains it
    completing = next(i for i in range(len(token_ids))
                      if "STOP" in tokenizer.decode(token_ids[:i + 1]))
    choice = full["choices"][0]
    assert full["usage"]["completion_tokens"] == completing + 1
    logprobs = choice["logprobs"]["tokens"] if endpoint == "completions" else \
        choice["logprobs"]["content"]
    assert len(logprobs) == completing + 1
    assert choice["finish_reason"] == "stop"
    text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
    assert text == MULTIBYTE_TEXT[:MULTIBYTE_TEXT.index("STOP")]
    assert engine.aborted  # the engine did not know about the stop string: it is told to stop


# ---------------------------------------------------------------- bodies that used to 500
def test_the_largest_seed_with_n_choices_is_answered(tokenizer):
    engine = ScriptedEngine(lambda j: token_deltas([42], [1], with_logprobs=False))
    body = CompletionRequest.model_validate({"prompt": [1, 2], "n": 2, "seed": 2**63 - 1,
                                             "max_tokens": 1})
    response = run(serving_for(engine, tokenizer), body)
    assert [c["finish_reason"] for c in response["choices"]] == ["length", "length"]
    seeds = [params.seed for _, params, _ in engine.added]
    assert seeds == [2**63 - 1, 0]  # distinct, and within the range a generator takes


def test_cache_salt_reaches_the_engine_with_the_key_tenant(tokenizer):
    """Tenancy of state that outlives a request: by API key and cache_salt; none of either = none."""
    salts = []
    for tenant, salt in ((None, None), (None, "team-a"), ("key:1f2e", None),
                         ("key:1f2e", "team-a")):
        engine = ScriptedEngine(lambda j: token_deltas([42], [1], with_logprobs=False))
        body = CompletionRequest.model_validate({"prompt": [1], "max_tokens": 1,
                                                 **({"cache_salt": salt} if salt else {})})
        run(serving_for(engine, tokenizer), body, tenant=tenant)
        salts.append(engine.added[0][2])
    assert salts[0] is None
    assert len(set(salts[1:])) == 3
