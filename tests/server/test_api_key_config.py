"""An API key that is set but empty (`--api-key ""`, `SPECSERVE_API_KEY=`, an empty Kubernetes
Secret) refuses to start the server, with a message naming where it came from, before any model
loads: it must never mean "every bearer token gets in"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_server import find_free_port

from server.cli import main, resolve_api_key


@pytest.mark.parametrize("flag, environ, expected", [
    (None, {}, None),  # neither set: no key asked for, as before
    ("s3cret", {}, "s3cret"),
    (None, {"SPECSERVE_API_KEY": "s3cret"}, "s3cret"),
    ("flag-key", {"SPECSERVE_API_KEY": "env-key"}, "flag-key"),  # the flag wins
    ("flag-key", {"SPECSERVE_API_KEY": ""}, "flag-key"),
])
def test_the_key_comes_from_the_flag_then_the_environment(flag, environ, expected):
    assert resolve_api_key(flag, environ) == expected


@pytest.mark.parametrize("flag, environ, message", [
    ("", {}, "--api-key is set but empty"),
    (" \t", {}, "--api-key is set but empty"),
    (None, {"SPECSERVE_API_KEY": ""}, "SPECSERVE_API_KEY is set but empty"),
    (None, {"SPECSERVE_API_KEY": "\n"}, "SPECSERVE_API_KEY is set but empty"),
    ("", {"SPECSERVE_API_KEY": "env-key"}, "--api-key is set but empty"),
    (None, {"SPECSERVE_API_KEY": "s3cret\n"}, "SPECSERVE_API_KEY starts or ends with whitespace"),
])
def test_a_blank_key_is_refused(flag, environ, message):
    with pytest.raises(ValueError, match=message):
        resolve_api_key(flag, environ)


@pytest.mark.parametrize("argv, env_value, message", [
    (["--api-key", ""], None, "--api-key is set but empty"),
    ([], "", "SPECSERVE_API_KEY is set but empty"),
    ([], "   ", "SPECSERVE_API_KEY is set but empty"),
])
def test_serve_exits_2_before_loading_anything(monkeypatch, capsys, argv, env_value, message):
    """In process: exit code 2 and the message; the engine and the server are never started."""
    import server.serve

    async def must_not_serve(*_):
        raise AssertionError("serve() ran despite an empty API key")

    monkeypatch.setattr(server.serve, "serve", must_not_serve)
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    if env_value is not None:
        monkeypatch.setenv("SPECSERVE_API_KEY", env_value)
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, env_value, message", [
    (["--api-key", ""], None, "--api-key is set but empty"),
    ([], "", "SPECSERVE_API_KEY is set but empty"),
])
def test_the_real_command_refuses_an_empty_key(argv, env_value, message):
    """`python -m server.cli serve` as a deployment runs it: exits 2 with the message on stderr
    and never serves (were the check skipped, it would load the model and serve until the
    timeout, on a free port of its own)."""
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
    if env_value is not None:
        env["SPECSERVE_API_KEY"] = env_value
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port",
                           str(find_free_port()), *argv],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "serving the OpenAI API" not in done.stderr + done.stdout
