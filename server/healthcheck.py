"""The container's health probe (the Dockerfile's HEALTHCHECK): GET /health on the address the
server was started with, read from its command line, so `docker run ... --port 8123` (with
--network host, say) is probed on 8123, not on a fixed 8000.

It finds the `specserve serve` process (PID 1's command line, tini's, first; else any process),
parses its flags with the server's own parser (so defaults, `--port=N` and abbreviations mean what
they mean to the server) and exits 0 when /health answers 200, 1 otherwise. Reading the flags
imports no torch (server/cli.py), so a probe costs a fraction of a second.

    python -m server.healthcheck [--pid PID] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

# a server bound to every interface is asked on the loopback one
_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "localhost": "127.0.0.1"}


def command_line(pid: int | str) -> list[str] | None:
    """The process's argv (Linux /proc); None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            raw = file.read()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def serve_arguments(argv: list[str]) -> list[str] | None:
    """The arguments from `serve` on, if `argv` runs `specserve serve` (the console script, or
    `python -m server.cli serve`); None otherwise."""
    for index, part in enumerate(argv[:-1]):
        is_program = os.path.basename(part) == "specserve" or (
            part == "server.cli" and index > 0 and argv[index - 1] == "-m")
        if is_program and argv[index + 1] == "serve":
            return argv[index + 1:]
    return None


def _candidate_pids() -> Iterator[str]:
    yield "1"
    yield from sorted((name for name in os.listdir("/proc") if name.isdigit() and name != "1"),
                      key=int)


def find_server_arguments(pid: int | None = None) -> list[str] | None:
    """`serve` and its flags: of process `pid`, or of the first `specserve serve` process found."""
    pids = [str(pid)] if pid is not None else _candidate_pids()
    for candidate in pids:
        argv = command_line(candidate)
        arguments = None if argv is None else serve_arguments(argv)
        if arguments is not None:
            return arguments
    return None


def health_url(arguments: list[str]) -> str:
    """http://HOST:PORT/health for a server started with `arguments` (`serve` and its flags)."""
    from server.cli import build_parser

    args, _ = build_parser().parse_known_args(arguments)
    host = _ANY_ADDRESS.get(args.host, args.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{args.port}/health"


def is_healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.healthcheck", description=__doc__)
    parser.add_argument("--pid", type=int, default=None,
                        help="the server's process (default: PID 1, else the first found)")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for /health")
    options = parser.parse_args(argv)
    arguments = find_server_arguments(options.pid)
    if arguments is None:
        print("healthcheck: no `specserve serve` process found", file=sys.stderr)
        return 1
    url = health_url(arguments)
    if not is_healthy(url, options.timeout):
        print(f"healthcheck: {url} did not answer 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
