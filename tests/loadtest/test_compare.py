"""Compare mode's pieces without the model: configuration parsing, the `specserve serve` command,
and the launch / health / SIGTERM lifecycle around a stand-in server."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from loadtest.compare import (
    LaunchedServer,
    ServerConfig,
    parse_server_config,
    parse_server_configs,
    serve_command,
)

# answers 200 on /health; Python's default SIGTERM handling ends it
STAND_IN_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_configurations_by_name_json_and_label():
    assert parse_server_config("none", 3) == ServerConfig("none", None)
    assert parse_server_config("ngram", 4) == ServerConfig(
        "ngram", {"method": "ngram", "num_speculative_tokens": 4})
    assert parse_server_config('{"method": "suffix", "num_speculative_tokens": 5}', 3) == \
        ServerConfig("suffix", {"method": "suffix", "num_speculative_tokens": 5})
    assert parse_server_config('ngram5={"method": "ngram", "num_speculative_tokens": 5}', 3) \
        .label == "ngram5"
    assert parse_server_config("plain=off", 3) == ServerConfig("plain", None)
    for bad in ('{"num_speculative_tokens": 2}', "{broken", "not a method"):
        with pytest.raises(ValueError):
            parse_server_config(bad, 3)
    with pytest.raises(ValueError, match="labels must differ"):
        parse_server_configs(["ngram", '{"method": "ngram"}'], 3)


def test_the_serve_command_binds_loopback_and_passes_the_config():
    config = ServerConfig("ngram", {"method": "ngram", "num_speculative_tokens": 3})
    command = serve_command(config, 8123, ["--num-threads", "1"])
    assert command[:4] == [sys.executable, "-m", "server.cli", "serve"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == "8123"
    assert json.loads(command[command.index("--speculative-config") + 1]) == \
        config.speculative_config
    assert command[-2:] == ["--num-threads", "1"]
    plain = serve_command(ServerConfig("none", None), 8123, [])
    assert plain[plain.index("--speculative-config") + 1] == "none"  # the default speculates


def test_a_launched_server_is_awaited_then_stopped_with_sigterm():
    server = LaunchedServer(ServerConfig("stand-in", None), [], start_timeout_s=20)
    server.command = [sys.executable, "-c", STAND_IN_SERVER, str(server.port)]
    with server:
        assert server.process.poll() is None
    assert server.process.returncode == -signal.SIGTERM


def test_a_server_that_dies_at_start_up_is_reported_with_its_output():
    server = LaunchedServer(ServerConfig("broken", None), [], start_timeout_s=20)
    server.command = [sys.executable, "-c", "print('bad flag: --oops'); raise SystemExit(1)"]
    with pytest.raises(RuntimeError, match="bad flag: --oops"), server:
        pass
