"""Limits on a request body, checked before any of it is parsed: its size (413), how long the client
takes to send it (408), and how many JSON values it holds (413), so one client cannot make the
server hold a connection forever or parse for seconds on the event loop.

Why count values: parsing JSON holds the GIL, on a thread too, and costs by the value, not by the
byte (15 MiB of `[1],[1],...` took 3.2 s, 15 MiB of text 0.02 s). Counting the bytes that open or
separate values (`,` `:` `[` `{`, and `.` for floats) as each chunk arrives is a C scan of well under
a millisecond a chunk, and bounds the parse. Those bytes inside strings count as well, which only
ever overstates.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import ApiError

# 16 MiB: a 128k-token prompt is about 1 MB of JSON token ids, so this leaves room for batches
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# seconds a client has to send its whole body once its headers are in
DEFAULT_READ_TIMEOUT = 30.0
# what the parser spends, in units of one integer in an array (~0.1 us): a list or object ~16, a
# float ~4 (measured with json.loads on this project's CPUs)
CONTAINER_WEIGHT = 16
FLOAT_WEIGHT = 4
# JSON parse work a body may ask for: at most ~50-80 ms of parsing on a busy 2-core machine, and
# room for 400,000 token ids (three 128k-token prompts) or ~500 KB of code as a prompt
MAX_JSON_VALUES = 400_000


def json_parse_cost(body: bytes) -> int:
    """An upper bound on the parse work of `body`, in units of one integer in an array."""
    num_separators = body.count(b",") + body.count(b":")
    num_containers = body.count(b"[") + body.count(b"{")
    return num_separators + CONTAINER_WEIGHT * num_containers + FLOAT_WEIGHT * body.count(b".")


class BodySizeLimit:
    """ASGI middleware: reads the whole body (at most `max_bytes`, within `read_timeout` seconds
    of the headers), checks what parsing it would cost, then hands it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)  # NOTE: refused before reading a byte of it
            return
        try:
            async with asyncio.timeout(self.read_timeout):
                body = await self._read_body(receive)
        except TimeoutError:
            error = ApiError(408, f"the request body did not arrive within this server's "
                                  f"{self.read_timeout:g} s", code="request_timeout")
            await error.send_asgi(send, [(b"connection", b"close")])
            return
        except _BodyTooLarge:
            await self._too_large(send)
            return
        except _TooManyValues:
            error = ApiError(413, f"the request body asks for too much JSON parsing: more than "
                                  f"{MAX_JSON_VALUES} units (each comma, colon and decimal point "
                                  f"counts 1, each [ or {{ {CONTAINER_WEIGHT}, inside strings "
                                  f"too); send shorter lists", code="request_too_large")
            await error.send_asgi(send, [(b"connection", b"close")])
            return
        except _ClientLeft:
            return
        is_replayed = False

        async def replay() -> Message:
            # the body once, then the connection's own messages (the app polls for a disconnect)
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> bytes:
        chunks, size, cost = [], 0, 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            # NOTE: chunk by chunk, as it arrives, so no single scan holds the loop
            cost += json_parse_cost(chunk)
            if cost > MAX_JSON_VALUES:
                raise _TooManyValues
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        error = ApiError(413, f"the request body is larger than this server's limit of "
                              f"{self.max_bytes / 2**20:g} MiB", code="request_too_large")
        await error.send_asgi(send, [(b"connection", b"close")])


class _BodyTooLarge(Exception):
    pass


class _TooManyValues(Exception):
    pass


class _ClientLeft(Exception):
    """The client went away before sending its whole body: nobody is left to answer."""
