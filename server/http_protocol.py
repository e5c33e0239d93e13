"""uvicorn's HTTP/1.1 protocol (h11) with two limits it lacks: a deadline for a request's headers, and
a cap on open connections.

uvicorn starts no timer until a first response is sent, and any byte a client sends cancels its
keep-alive timer, so a client that connects and sends nothing, or a byte a minute, held a
connection forever. Here every request's headers must be complete within `read_timeout` seconds of
the connection opening (or of the previous response): otherwise 408 and the connection is closed.
The body's own deadline is server/body_limit.py's. Connections beyond `max_connections` get a 503
and are closed at once, before anything is read (uvicorn's `limit_concurrency` instead admits them
and refuses each request once its headers are in, in plain text).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import ApiError

DEFAULT_MAX_CONNECTIONS = 1024


def limited_h11_protocol(read_timeout: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"read_timeout": read_timeout, "max_connections": max_connections})


class LimitedH11Protocol(H11Protocol):
    read_timeout: float = 30.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(ApiError(503, f"this server has {self.max_connections} connections open, "
                                       "its limit; retry shortly", code="too_many_connections",
                                  retry_after=1))
            return
        self._arm_header_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in (or it broke)
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this keep-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ internals
    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.read_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._refuse(ApiError(408, f"the request headers did not arrive within this server's "
                                   f"{self.read_timeout:g} s", code="request_timeout"))

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` without a request to answer (h11 would refuse to), and close."""
        body = error.body_bytes()
        headers = {"content-type": "application/json", "content-length": str(len(body)),
                   "connection": "close", **error.headers}
        head = f"HTTP/1.1 {error.status} {_REASONS[error.status]}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
        self.transport.write(head.encode() + body)
        self.transport.close()


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}
