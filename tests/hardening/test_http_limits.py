"""HTTP limits (reproduction 4 of issue 28): a client that announces a body and sends 1 byte, or
never finishes its headers, gets 408 and is disconnected after --read-timeout instead of holding its
connection forever; connections beyond --max-connections get 503 and are closed."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest
from live_server import LiveServer

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

READ_TIMEOUT = 1.5
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def server(tiny_chat_llama):
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len", "256",
                     "--speculative-config", "none", "--read-timeout", str(READ_TIMEOUT),
                     "--max-connections", str(MAX_CONNECTIONS)]) as server:
        yield server


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=15)
    return sock


def read_until_closed(sock: socket.socket, limit: float = 15.0) -> bytes:
    """Everything the server sends until it closes the connection (or `limit` seconds pass)."""
    data, deadline = b"", time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_body_that_never_arrives_gets_408_and_the_connection_closes(server):
    with contextlib.closing(connect(server)) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100000\r\n\r\n{")
        raw = read_until_closed(sock)
        elapsed = time.monotonic() - start
    status, error = status_and_error(raw)
    assert status == 408 and error["code"] == "request_timeout", raw
    assert elapsed < READ_TIMEOUT + 10  # closed, not held


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_headers_that_never_finish_get_408_and_the_connection_closes(server, sent):
    with contextlib.closing(connect(server)) as sock:
        sock.sendall(sent)
        for _ in range(3):  # a byte now and then does not extend the deadline
            time.sleep(READ_TIMEOUT / 4)
            with contextlib.suppress(OSError):
                sock.sendall(b"X")
        raw = read_until_closed(sock)
    assert raw, "the connection was held open"
    assert status_and_error(raw)[0] == 408


def test_a_keep_alive_connection_serves_several_requests(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(READ_TIMEOUT / 3)


def test_connections_beyond_the_cap_get_503(server):
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        with contextlib.closing(connect(server)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = read_until_closed(extra)
        status, error = status_and_error(raw)
        assert status == 503 and error["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # room again
