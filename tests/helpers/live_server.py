"""A real `specserve serve` on 127.0.0.1 in a child process, for tests that talk HTTP to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_server import find_free_port


class LiveServer:
    """`with LiveServer(["--speculative-config", ...]) as server: server.url` (…/v1 is server.api).

    `launcher` is the command before `serve` (default: `python -m server.cli`), e.g. a
    `python -c` that patches the server before calling server.cli.main, to inject a fault.
    """

    def __init__(self, args: list[str], start_timeout: float = 180.0,
                 launcher: list[str] | None = None) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.url}/v1"
        self.args = args
        self.launcher = launcher or [sys.executable, "-m", "server.cli"]
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LiveServer:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specserve-", suffix=".log", delete=False)
        env = dict(os.environ, SPECSERVE_NO_PROGRESS="1")
        self.process = subprocess.Popen(
            [*self.launcher, "serve", "--port", str(self.port),
             "--num-threads", "1", *self.args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"specserve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"specserve did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self.log.name)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples in /metrics (all label sets)."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == name)



def child_pids(parent_pid: int, marker: bytes) -> list[int]:
    """The processes whose parent is `parent_pid` and whose command line holds `marker`."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == parent_pid and marker in command:
            pids.append(int(entry))
    return pids


def engine_pid(server_pid: int) -> int:
    """The engine process of a server: its child started by multiprocessing's spawn (the other
    child, if any, is multiprocessing's resource tracker)."""
    pids = child_pids(server_pid, b"spawn_main")
    if not pids:
        raise LookupError(f"no engine process under {server_pid}")
    return pids[0]


# NOTE: a dead engine makes the server exit at once (EngineCallbacks.on_dead), so a /health probe
# right after races the closing listener. This patch keeps it answering for `delay` seconds first,
# so a test can prove a live server says 503 (not merely that nothing answers), then still exits.
_EXIT_LATE = """
import sys
import threading
import server.serve
from server.cli import main

_on_dead = server.serve.EngineCallbacks.on_dead

def _late_on_dead(self):
    threading.Timer({delay}, _on_dead, args=(self,)).start()

server.serve.EngineCallbacks.on_dead = _late_on_dead
{extra}
sys.exit(main())
"""


def launcher_exiting_late(delay: float = 6.0, extra: str = "") -> list[str]:
    """A LiveServer launcher whose server exits `delay` seconds after its engine dies (instead of
    at once), after running the Python `extra` (e.g. a fault injection)."""
    return [sys.executable, "-c", _EXIT_LATE.format(delay=delay, extra=extra)]


def assert_health_is_503(url: str) -> None:
    """The server answers /health, with 503: a closed port (a transport error) fails this."""
    response = httpx.get(f"{url}/health", timeout=5)
    assert response.status_code == 503, response
