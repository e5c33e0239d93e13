"""Errors the API answers with, in OpenAI's shape, with the status each deserves."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    # the request field at fault, e.g. "temperature" or "messages.0.role"
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo

    @classmethod
    def build(cls, message: str, *, type: str = "invalid_request_error", param: str | None = None,
              code: str | int | None = None) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=type, param=param, code=code))

    @classmethod
    def from_validation_errors(cls, errors: Sequence[Mapping[str, Any]]) -> ErrorResponse:
        """From pydantic's `ValidationError.errors()` or FastAPI's `RequestValidationError.errors()`;
        every message is prefixed by its field, and `param` names the first field at fault."""
        described = []
        params = []
        for error in errors:
            loc = [str(part) for part in error.get("loc", ())]
            # FastAPI puts the request part first: ("body", "temperature")
            if loc and loc[0] == "body":
                loc = loc[1:]
            param = ".".join(loc) or None
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            described.append(f"{param}: {message}" if param else message)
            params.append(param)
        return cls.build("; ".join(described) or "invalid request",
                         param=next((p for p in params if p), None))


_DEFAULT_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                  408: "RequestTimeoutError", 413: "RequestTooLargeError", 429: "RateLimitError",
                  500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, type: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _DEFAULT_TYPES.get(status, "APIError")
        # seconds, sent as the Retry-After header (429, 503)
        self.retry_after = retry_after

    def body(self) -> dict:
        return ErrorResponse.build(self.message, type=self.type, param=self.param,
                                   code=self.code).model_dump()

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    async def send_asgi(self, send: Any, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Answer with this error straight from ASGI middleware, before any route runs."""
        payload = self.body_bytes()
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                *extra_headers]})
        await send({"type": "http.response.body", "body": payload})
