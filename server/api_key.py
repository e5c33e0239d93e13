"""The API key check, as ASGI middleware in front of everything else: a request to /v1 without the key
gets 401 before a byte of its body is read or parsed, so a client without the key costs the server
nothing but its headers."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError

PROTECTED_PREFIX = "/v1"


class ApiKeyCheck:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key.strip():
            # NOTE: an empty key would let every `Bearer ` header in; the CLI refuses it earlier
            raise ValueError("the API key must not be empty")
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]) and not self._has_key(scope):
            await _unauthorized(send)
            return
        await self.app(scope, receive, send)

    def _has_key(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # NOTE: constant-time comparison, so response timing does not leak the key
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.api_key)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


async def _unauthorized(send: Send) -> None:
    error = ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                     code="invalid_api_key")
    await error.send_asgi(send, [(b"www-authenticate", b"Bearer")])
