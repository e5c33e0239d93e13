"""A real Prometheus (Debian package `prometheus`) scraping one target on 127.0.0.1, for tests that
check our PromQL against the actual query engine rather than against our own arithmetic.

    with PrometheusServer("127.0.0.1:8000") as prometheus:
        value = prometheus.wait_for_number("up", timeout_s=10)
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx


def find_prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def find_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    """Runs the binary with a temp config and data dir; stopped (and cleaned up) on exit."""

    def __init__(self, target: str, *, scrape_interval_s: float = 1.0,
                 ready_timeout_s: float = 15.0) -> None:
        binary = find_prometheus_binary()
        if binary is None:
            raise FileNotFoundError("no prometheus binary: apt-get install -y prometheus")
        self.binary = binary
        self.target = target
        self.scrape_interval_s = scrape_interval_s
        self.ready_timeout_s = ready_timeout_s
        self.port = find_free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._client = httpx.Client(base_url=self.base_url, timeout=5.0)

    def __enter__(self) -> PrometheusServer:
        self._workdir = tempfile.TemporaryDirectory(prefix="specserve-prometheus-")
        workdir = Path(self._workdir.name)
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        # NOTE: JSON is valid YAML; the scrape timeout must not exceed the interval (default 10 s).
        config = {"global": {"scrape_interval": interval, "scrape_timeout": interval},
                  "scrape_configs": [{"job_name": "specserve",
                                      "static_configs": [{"targets": [self.target]}]}]}
        (workdir / "prometheus.yml").write_text(json.dumps(config))
        self._log_path = workdir / "prometheus.log"
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                [self.binary, f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._client.close()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
            self._process = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if self._client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready after {self.ready_timeout_s} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, num_chars: int = 2000) -> str:
        return self._log_path.read_text(errors="replace")[-num_chars:]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at now: the API's result list ({"metric": {...}, "value": [ts, "1.5"]})."""
        response = self._client.get("/api/v1/query", params={"query": expr})
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed ({response.status_code}): {body}")
        return body["data"]["result"]

    def wait_for_number(self, expr: str, *, timeout_s: float) -> float:
        """Poll until `expr` gives exactly one finite sample (rate() needs two scrapes first)."""
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if len(result) == 1 and math.isfinite(value := float(result[0]["value"][1])):
                return value
            time.sleep(self.scrape_interval_s / 4)
        raise TimeoutError(f"{expr!r} gave no single finite sample within {timeout_s} s; "
                           f"last result: {result}")
