"""The API key check, as ASGI middleware in front of everything else: a request to /v1 (or to
/tokenize and /detokenize) without a valid key gets 401 before a byte of its body is read or parsed, so a client without a key costs the
server nothing but its headers.

Each key is a tenant of its own (DESIGN.md "Tenancy"): the check puts the key's tenant, a digest
that never reveals the key, in the request's scope, and the server isolates the prefix cache and
suffix decoding's output cache by it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError

PROTECTED_PREFIX = "/v1"
# outside /v1 but costly (a chat template rendered, a text tokenized): keyed too
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})
# where the check leaves the tenant in the ASGI scope's "state" (Request.state.api_key_tenant)
TENANT_STATE_KEY = "api_key_tenant"


def key_tenant(api_key: str) -> str:
    """The tenant of a key: a digest, so neither logs nor the engine process ever see the key."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def request_tenant(request: Request) -> str | None:
    """The tenant the key check found for this request; None on a server without keys."""
    return getattr(request.state, TENANT_STATE_KEY, None)


class ApiKeyCheck:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        if not api_keys or any(not key.strip() for key in api_keys):
            # NOTE: an empty key would let every `Bearer ` header in; the CLI refuses it earlier
            raise ValueError("API keys must not be empty")
        self.app = app
        self.tenants = [(key.encode(), key_tenant(key)) for key in dict.fromkeys(api_keys)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]):
            tenant = self._tenant(scope)
            if tenant is None:
                await _unauthorized(send)
                return
            scope.setdefault("state", {})[TENANT_STATE_KEY] = tenant
        await self.app(scope, receive, send)

    def _tenant(self, scope: Scope) -> str | None:
        headers = Headers(scope=scope)
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        # Anthropic's clients send the key as `x-api-key: <key>` instead
        given = [bearer if scheme.lower() == "bearer" else "", headers.get("x-api-key", "")]
        found = None
        for key, tenant in self.tenants:
            # NOTE: constant-time comparisons against every key, so timing leaks no key
            for token in given:
                if token and hmac.compare_digest(token.encode(), key):
                    found = tenant
        return found


def _is_protected(path: str) -> bool:
    return (path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
            or path in PROTECTED_PATHS)


async def _unauthorized(send: Send) -> None:
    error = ApiError(401, "invalid or missing API key (Authorization: Bearer <key>, or "
                          "x-api-key: <key>)",
                     code="invalid_api_key")
    await error.send_asgi(send, [(b"www-authenticate", b"Bearer")])
