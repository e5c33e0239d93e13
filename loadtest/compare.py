"""Compare mode: launch `specserve serve` once per configuration (no speculation, then each
method) on a free loopback port, load it with the same requests, and stop it with SIGTERM.

A configuration on the command line is `none`, a method name (`ngram`, `suffix`, ...; k from
--num-speculative-tokens), or a JSON speculative config, each optionally prefixed `LABEL=`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx

NO_SPECULATION = ("none", "no-spec", "off")


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration to load-test."""

    label: str
    speculative_config: dict[str, Any] | None  # None: serve without speculation


def parse_server_config(text: str, num_speculative_tokens: int) -> ServerConfig:
    label, sep, spec = text.partition("=")
    if not sep or label.lstrip().startswith("{"):
        label, spec = "", text
    spec = spec.strip()
    if spec in NO_SPECULATION:
        return ServerConfig(label or "none", None)
    if spec.startswith("{"):
        try:
            config = json.loads(spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"bad JSON speculative config {spec!r}: {error.msg}") from None
        if not isinstance(config, dict) or "method" not in config:
            raise ValueError(f"a speculative config needs a \"method\": {spec!r}")
        return ServerConfig(label or str(config["method"]), config)
    if not spec.isidentifier():
        raise ValueError(f"not a configuration: {text!r} (none, a method name, or JSON)")
    return ServerConfig(label or spec, {"method": spec,
                                        "num_speculative_tokens": num_speculative_tokens})


def parse_server_configs(texts: list[str], num_speculative_tokens: int) -> list[ServerConfig]:
    configs = [parse_server_config(text, num_speculative_tokens) for text in texts]
    labels = [config.label for config in configs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"configuration labels must differ, repeated: {duplicates} "
                         "(name them LABEL=CONFIG)")
    return configs


def serve_command(config: ServerConfig, port: int, serve_args: list[str]) -> list[str]:
    """`specserve serve` for one configuration, bound to loopback only."""
    command = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port)]
    # NOTE: "none" spelled out: the server speculates unless told not to
    spec = "none" if config.speculative_config is None else json.dumps(config.speculative_config)
    return command + ["--speculative-config", spec] + serve_args


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """`with LaunchedServer(config, serve_args) as server: server.base_url` - healthy inside,
    stopped with SIGTERM (then killed after `stop_timeout_s`) on the way out."""

    def __init__(self, config: ServerConfig, serve_args: list[str],
                 start_timeout_s: float = 300.0, stop_timeout_s: float = 30.0) -> None:
        self.config = config
        self.port = free_loopback_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = serve_command(config, self.port, serve_args)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedServer:
        self.log = tempfile.TemporaryFile("w+")
        env = dict(os.environ, SPECSERVE_NO_PROGRESS="1")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.config.label}: specserve exited with "
                                   f"{self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.config.label}: specserve was not healthy within "
                           f"{self.start_timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-num_chars:]

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log.close()
