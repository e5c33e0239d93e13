"""The server's ASGI app with no engine behind it, and one request sent through it in process: for
tests of what happens before a request reaches the engine (API keys, body limits, error shapes)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from engine.messages import EngineReady
from server.app import ServerState, build_app
from server.body_limit import DEFAULT_MAX_BODY_BYTES
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing

KEY = "sk-test"


def engineless_app(tokenizer: Any = None, api_keys: tuple[str, ...] = (KEY,),
                   is_alive: bool = True, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """(app, serving) for a tiny model the engine never serves."""
    ready = EngineReady("tiny", 128, 96, "float32", "cpu", 8, 16, None, 0)
    client = SimpleNamespace(is_alive=is_alive, ready=ready)
    metrics = ServerMetrics("tiny", None, 0)
    serving = OpenAIServing(client, tokenizer, "tiny", metrics, max_waiting_requests=4)
    return build_app(ServerState(client, serving, metrics, api_keys=api_keys,
                                 max_body_bytes=max_body_bytes)), serving


async def asgi_request(app, path: str, body: bytes = b"{}", headers: dict[str, str] | None = None,
                       method: str = "POST", raises: type[Exception] | None = None
                       ) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the body was read). `raises`: the exception the app raises
    after answering (Starlette re-raises an unexpected one so that it is logged)."""
    was_read, sent = False, []

    async def receive():
        nonlocal was_read
        was_read = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    headers = {"content-type": "application/json", "content-length": str(len(body)),
               **(headers or {})}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    try:
        await app(scope, receive, send)
    except Exception as error:
        if raises is None or not isinstance(error, raises):
            raise
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    length = dict(start["headers"]).get(b"content-length")
    assert length is None or int(length) == len(payload)
    return start["status"], json.loads(payload), was_read
