"""Errors on /v1/messages paths come in Anthropic's shape, whoever raised them (a route, FastAPI's
body parsing, the API-key check, the body limit, an unexpected exception), with the status the
server uses elsewhere, while every other path keeps OpenAI's; and `x-api-key` authenticates like
`Authorization: Bearer`. In process, through the ASGI app, with no engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from engineless_app import KEY, asgi_request, engineless_app
from openai_errors import assert_openai_error

from server.messages_serving import MessagesServing

MESSAGE = json.dumps({"model": "tiny", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()


def build(api_keys=(KEY,), is_alive=True, max_body_bytes=2**20):
    return engineless_app(api_keys=api_keys, is_alive=is_alive, max_body_bytes=max_body_bytes)[0]


def call(app, path: str, body: bytes = b"{}", headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, dict, bool]:
    return asyncio.run(asgi_request(app, path, body, headers, method, raises=RuntimeError))


def anthropic_error(body: dict, error_type: str) -> str:
    """`body` is Anthropic's error shape with `error_type`; returns its message."""
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    assert body["error"]["type"] == error_type, body
    return body["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer nope"},
                                     {"authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_bad_key_gets_anthropic_401_before_the_body_is_read(headers, path) -> None:
    status, body, was_read = call(build(), path, MESSAGE, headers)
    assert status == 401 and not was_read
    assert "x-api-key" in anthropic_error(body, "authentication_error")


def test_other_paths_keep_the_openai_401() -> None:
    status, body, _ = call(build(), "/v1/chat/completions", MESSAGE, {"x-api-key": "wrong"})
    assert status == 401 and assert_openai_error(body)["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"},
                                     {"authorization": "Bearer nope", "x-api-key": KEY}])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_x_api_key_authenticates_like_bearer(headers, path) -> None:
    status, body, was_read = call(build(), path, b"{not json", headers)
    assert status == 400 and was_read  # past the key check: the body was read and found broken
    if path == "/v1/messages":
        assert "not valid JSON" in anthropic_error(body, "invalid_request_error")
    else:
        assert_openai_error(body)


@pytest.mark.parametrize("app_kw, path, body, method, status, error_type, words", [
    ({}, "/v1/messages", b"[1]", "POST", 400, "invalid_request_error", "JSON object"),
    ({}, "/v1/messages", json.dumps({"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image"}]}]}).encode(), "POST", 400,
     "invalid_request_error", "messages.0.content.0.type: image blocks"),
    ({}, "/v1/messages", MESSAGE.replace(b'"tiny"', b'"other"'), "POST", 404, "not_found_error",
     "'other' does not exist"),
    ({}, "/v1/messages", MESSAGE, "POST", 400, "invalid_request_error", "no chat template"),
    ({}, "/v1/messages/count_tokens", MESSAGE, "POST", 400, "invalid_request_error",
     "no chat template"),
    ({}, "/v1/messages", b"", "GET", 405, "invalid_request_error", "Method Not Allowed"),
    ({}, "/v1/messages/nothing", MESSAGE, "POST", 404, "not_found_error", "Not Found"),
    ({"max_body_bytes": 64}, "/v1/messages", MESSAGE * 2, "POST", 413, "request_too_large",
     "larger than"),
    ({"is_alive": False}, "/v1/messages", MESSAGE, "POST", 503, "overloaded_error",
     "engine is not running"),
], ids=["not_an_object", "image", "unknown_model", "no_template", "count_no_template",
        "wrong_method", "unknown_path", "too_large", "engine_down"])
def test_errors_on_messages_paths_take_anthropic_shape(app_kw, path, body, method, status,
                                                   error_type, words) -> None:
    got_status, got, _ = call(build(api_keys=(), **app_kw), path, body, method=method)
    assert got_status == status
    assert words in anthropic_error(got, error_type)


def test_an_unexpected_exception_gets_anthropic_500(monkeypatch) -> None:
    async def broken(*_, **__):
        raise RuntimeError("a bug")

    monkeypatch.setattr(MessagesServing, "create", broken)
    status, body, _ = call(build(api_keys=()), "/v1/messages", MESSAGE)
    assert status == 500 and anthropic_error(body, "api_error") == "internal server error"
