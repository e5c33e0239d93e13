"""Checks that an HTTP answer is an error in OpenAI's shape, for tests that talk to a live server."""

from __future__ import annotations

import json
from typing import Any

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_openai_error(body: bytes | str | Any, status: int | None = None) -> dict:
    """`body` (raw bytes, text or parsed JSON) is `{"error": {"message", "type", "param", "code"}}`
    with a non-empty message; returns the inner error object."""
    if isinstance(body, (bytes, str)):
        body = json.loads(body)
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error body: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"bad error object: {error!r}"
    assert isinstance(error["message"], str) and error["message"], f"empty message: {error!r}"
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], (str, int))
    return error
