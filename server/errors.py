"""Errors the API answers with, in OpenAI's shape, with the status each deserves."""

from __future__ import annotations

from server.protocol import ErrorResponse

_DEFAULT_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                  429: "RateLimitError", 503: "ServiceUnavailableError"}


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
