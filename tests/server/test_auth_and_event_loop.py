"""The API key is checked before a byte of the body is read, and a slow chat template renders off
the event loop, so neither an unauthenticated client nor a long conversation stalls other requests."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from engineless_app import KEY, asgi_request, engineless_app

from server.api_requests import ChatCompletionRequest


def app_with_key(tokenizer=None):
    return engineless_app(tokenizer)


async def call(app, path: str, headers: dict[str, str], body: bytes):
    return await asgi_request(app, path, body, headers)


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"},
                                     {"authorization": f"Basic {KEY}"},
                                     {"authorization": "Bearer "}])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models",
                                  "/tokenize", "/detokenize"])
def test_a_bad_key_gets_401_before_the_body_is_read(headers, path):
    app, _ = app_with_key()
    big = json.dumps({"prompt": "x" * 100_000, "max_tokens": 1}).encode()
    status, body, was_read = asyncio.run(call(app, path, headers, big))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert not was_read


def test_the_right_key_reaches_the_route():
    app, _ = app_with_key()
    status, body, was_read = asyncio.run(call(app, "/v1/completions",
                                              {"authorization": f"Bearer {KEY}"}, b"{not json"))
    assert status == 400 and was_read  # past the key check: the body was read and found broken


class SlowTemplateTokenizer:
    """A tokenizer whose chat template takes half a second of blocking work."""

    chat_template = "{{ messages }}"

    def get_vocab(self) -> dict[str, int]:
        return {"hi": 0}

    def apply_chat_template(self, messages, **_):
        time.sleep(0.5)
        raise ValueError("stop here: rendering is all this test needs")


def test_the_chat_template_renders_off_the_event_loop():
    _, serving = app_with_key(SlowTemplateTokenizer())
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})

    async def go() -> int:
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        with pytest.raises(Exception, match="chat template rejected"):
            await serving.chat(body, lambda: False)
        task.cancel()
        return ticks

    # NOTE: rendering on the loop would leave the ticker 0 or 1 ticks in those 0.5 s
    assert asyncio.run(go()) >= 10
