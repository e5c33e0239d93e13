"""Live servers shared by the whole pytest session: a server is started the first time a test asks
for its command line and stopped when the session ends, so modules that need the same server
(`specserve serve` as README starts it, say) pay its start once.

Only tests that leave a server as they found it may share it: no killed engines, no drained
servers, no assertions on counters that other tests also move. Those start their own LiveServer.
"""

from __future__ import annotations

import pytest
from live_server import LiveServer

# `specserve serve` as README starts it (the embedded model, adaptive suffix decoding, prefix
# caching on, no API key), with room for the tool-calling conversations
EMBEDDED_DEFAULT = ("--max-model-len", "1024")


class ServerPool:
    """One LiveServer per distinct command line, started on first use."""

    def __init__(self) -> None:
        self._servers: dict[tuple[str, ...], LiveServer] = {}

    def get(self, args: list[str] | tuple[str, ...]) -> LiveServer:
        key = tuple(args)
        server = self._servers.get(key)
        if server is not None and server.process.poll() is not None:
            raise RuntimeError(f"a shared server died ({server.process.returncode}); a test that "
                               f"stops or kills its server must start its own:\n{server.output()}")
        if server is None:
            server = self._servers[key] = LiveServer(list(key)).__enter__()
        return server

    def close(self) -> None:
        for server in self._servers.values():
            server.__exit__(None, None, None)
        self._servers.clear()


@pytest.fixture(scope="session")
def server_pool():
    pool = ServerPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def embedded_server(server_pool: ServerPool) -> LiveServer:
    """The embedded model served as README's set-up command serves it."""
    return server_pool.get(EMBEDDED_DEFAULT)
