"""The container's health probe reads the address from the server's own command line, with the
server's own parser: the last --port wins, as it does for the server, and a server bound to every
interface is asked on the loopback one."""

from __future__ import annotations

import pytest

from server.healthcheck import health_url, serve_arguments

ENTRYPOINT = ["tini", "--", "/opt/venv/bin/specserve", "serve", "--host", "0.0.0.0", "--port", "8000"]


@pytest.mark.parametrize("argv, url", [
    (ENTRYPOINT, "http://127.0.0.1:8000/health"),
    (ENTRYPOINT + ["--port", "8123"], "http://127.0.0.1:8123/health"),
    (ENTRYPOINT + ["--port=9000", "--model", "/models/x"], "http://127.0.0.1:9000/health"),
    (ENTRYPOINT + ["--host", "10.0.0.5"], "http://10.0.0.5:8000/health"),
    (ENTRYPOINT + ["--host", "::"], "http://[::1]:8000/health"),
    (["/usr/bin/python3", "-m", "server.cli", "serve", "--port", "8200"],
     "http://127.0.0.1:8200/health"),
])
def test_the_url_follows_the_servers_flags(argv, url):
    assert health_url(serve_arguments(argv)) == url


@pytest.mark.parametrize("argv", [["tini", "--", "specserve", "generate", "hi"],
                                  ["python", "-m", "pytest"], ["specserve"], []])
def test_a_process_that_does_not_serve_is_not_the_server(argv):
    assert serve_arguments(argv) is None
