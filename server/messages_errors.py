"""Errors on the Messages API's paths in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with the status the server answers anywhere else (400, 401, 404, 413, 429, 503 ...).

Every handler and middleware writes its errors in OpenAI's shape once; AnthropicErrorShape, outside
them all, reshapes those on /v1/messages paths, the API key's 401 and the body limit's 413 included.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import ApiError

MESSAGES_PATH = "/v1/messages"
# Anthropic's error type for each status; other statuses: invalid_request_error (4xx), api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class ErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """An error body, and the data of a stream's `error` event."""

    type: Literal["error"] = "error"
    error: ErrorDetail

    @classmethod
    def build(cls, status: int, message: str, param: str | None = None) -> AnthropicError:
        """Anthropic's errors carry no `param`: a message that does not name its field is
        prefixed with it."""
        if param and param not in message:
            message = f"{param}: {message}"
        error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                     else "api_error")
        return cls(error=ErrorDetail(type=error_type, message=message))

    @classmethod
    def from_api_error(cls, error: ApiError) -> AnthropicError:
        return cls.build(error.status, error.message, error.param)


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicErrorShape:
    """ASGI middleware: an error answer with an OpenAI error body on a /v1/messages path goes out
    in Anthropic's shape; everything else passes untouched. An exception no handler answered
    (a bug) gets Anthropic's 500 here, then goes on to be logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # an error's response start, held until its body is in
        chunks: list[bytes] = []
        is_started = False

        async def reshaping_send(message: Message) -> None:
            nonlocal held, is_started
            if message["type"] == "http.response.start":
                is_started = True
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                if message["status"] >= 400 and content_type.startswith("application/json"):
                    held = message
                    return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_reshaped(send, held, b"".join(chunks))

        try:
            await self.app(scope, receive, reshaping_send)
        except Exception:
            if not is_started:
                await _send_error(send, AnthropicError.build(500, "internal server error"), 500)
            raise


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        return body  # not an OpenAI error body: left as it is
    return AnthropicError.build(status, message, param if isinstance(param, str) else None) \
        .model_dump_json().encode()


async def _send_reshaped(send: Send, start: Message, body: bytes) -> None:
    reshaped = _reshaped(start["status"], body)
    headers = MutableHeaders(raw=list(start.get("headers", [])))
    headers["content-length"] = str(len(reshaped))
    await send({**start, "headers": headers.raw})
    await send({"type": "http.response.body", "body": reshaped})


async def _send_error(send: Send, error: AnthropicError, status: int) -> None:
    body = error.model_dump_json().encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
