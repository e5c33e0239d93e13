"""The API key is checked before a byte of the body is read, and a slow chat template renders off
the event loop, so neither an unauthenticated client nor a long conversation stalls other requests."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from engine.messages import EngineReady
from server.api_requests import ChatCompletionRequest
from server.app import ServerState, build_app
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing

KEY = "sk-test"


def app_with_key(tokenizer=None):
    ready = EngineReady("tiny", 128, 96, "float32", "cpu", 8, 16, None, 0)
    client = SimpleNamespace(is_alive=True, ready=ready)
    metrics = ServerMetrics("tiny", None, 0)
    serving = OpenAIServing(client, tokenizer, "tiny", metrics, max_waiting_requests=4)
    return build_app(ServerState(client, serving, metrics, api_keys=(KEY,))), serving


async def call(app, path: str, headers: dict[str, str], body: bytes):
    """One request through the ASGI app; returns (status, body, whether the body was read)."""
    was_read = False
    sent: list[dict] = []

    async def receive():
        nonlocal was_read
        was_read = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         {"content-type": "application/json",
                          "content-length": str(len(body)), **headers}.items()]}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload), was_read


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"},
                                     {"authorization": f"Basic {KEY}"},
                                     {"authorization": "Bearer "}])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
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
