"""A cap on request body size: a body over the limit gets 413 in OpenAI's error shape before any of
it is parsed, so one client cannot make the server hold or parse hundreds of megabytes."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import ApiError

# 16 MiB: a 128k-token prompt is about 1 MB of JSON token ids, so this leaves room for batches
DEFAULT_MAX_BODY_BYTES = 16 * 2**20


class BodySizeLimit:
    """ASGI middleware: reads the whole body (at most `max_bytes`), then hands it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)  # NOTE: refused before reading a byte of it
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        is_replayed = False

        async def replay() -> Message:
            # the body once, then the connection's own messages (the app polls for a disconnect)
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        error = ApiError(413, f"the request body is larger than this server's limit of "
                              f"{self.max_bytes / 2**20:g} MiB", code="request_too_large")
        await error.send_asgi(send, [(b"connection", b"close")])
