"""Request bodies that once held the server's event loop or crashed a request, and a /health prober
that measures the loop's responsiveness while they are in flight (tests/hardening and
benchmarks/bench_health_under_flood.py share them)."""

from __future__ import annotations

import json
import threading
import time

import httpx

# 8,000,000 stop_token_ids in a ~15 MiB body: accepted once, with /health at 12.7 s meanwhile
NUM_FLOOD_STOP_IDS = 7_800_000
# a json_schema nested ~950 deep: a RecursionError (500) once
DEEP_SCHEMA_LEVELS = 950


def stop_ids_flood_body() -> bytes:
    head = b'{"prompt": "Hi", "max_tokens": 1, "stop_token_ids": ['
    return head + b",".join([b"1"] * NUM_FLOOD_STOP_IDS) + b"]}"


def deep_schema_body(levels: int = DEEP_SCHEMA_LEVELS) -> bytes:
    """Written out as text: json.dumps would recurse once per level, past the interpreter's limit
    in a caller that already sits deep in the stack (an xdist worker collecting a module)."""
    nesting = levels // 2
    schema = '{"type": "object", "properties": {"a": ' * nesting + '{"type": "string"}' + \
        "}}" * nesting
    body = ('{"prompt": "Hi", "max_tokens": 1, "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "deep", "schema": ' + schema + "}}}")
    return body.encode()


def huge_prompt_body(num_chars: int = 12 * 2**20) -> bytes:
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    text = (words * (num_chars // len(words) + 1))[:num_chars]
    return json.dumps({"prompt": text, "max_tokens": 1}).encode()


def small_chat_body(max_tokens: int = 4) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Say hi"}],
                       "max_tokens": max_tokens}).encode()


class HealthProbe:
    """Polls GET /health every `interval` s on its own thread; `latencies` are the seconds each
    answer took (a probe that timed out counts its timeout)."""

    def __init__(self, base_url: str, interval: float = 0.05, timeout: float = 30.0) -> None:
        self.base_url = base_url
        self.interval = interval
        self.timeout = timeout
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    self.statuses.append(client.get(f"{self.base_url}/health").status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                self.latencies.append(time.perf_counter() - start)
                self._stop.wait(self.interval)

    @property
    def max(self) -> float:
        return max(self.latencies, default=0.0)

    @property
    def p50(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[len(ordered) // 2] if ordered else 0.0


def post(base_url: str, path: str, body: bytes, timeout: float = 120.0,
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """(status, JSON body or {}) of one POST; status 0 when the connection failed."""
    try:
        response = httpx.post(f"{base_url}{path}", content=body, timeout=timeout,
                              headers={"content-type": "application/json", **(headers or {})})
    except httpx.HTTPError:
        return 0, {}
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {}
