"""The engine-killed-under-load scenario, shared by tests/hardening and benchmarks/bench_engine_kill.py:
requests that are really generating (streams with tokens flowing, plain requests waiting), then
SIGKILL to the engine process, and for each request how long after the kill it ended and how."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestEnd:
    """How one in-flight request ended after the kill."""

    is_stream: bool
    # HTTP status of the response (a stream's is 200: it began before the kill)
    status: int | None = None
    # the OpenAI error object received: the body of a plain request, an SSE event of a stream
    error: dict | None = None
    # seconds from the kill to the error (plain: the response; stream: the error event)
    seconds_to_error: float | None = None
    # seconds from the kill to the end of the exchange (stream closed, response read)
    seconds_to_end: float | None = None
    # stream events: tokens before the kill, then everything after it
    num_events_before_kill: int = 0
    events_after_kill: list[str] = field(default_factory=list)
    # a transport error instead of an answer (connection reset, ...)
    transport_error: str | None = None


@dataclass
class KillResult:
    # time.monotonic() at the SIGKILL
    killed_at: float
    # the streams first, then the plain requests
    ends: list[RequestEnd]


class _Clock:
    killed_at: float | None = None

    def since_kill(self) -> float | None:
        return None if self.killed_at is None else time.monotonic() - self.killed_at


async def kill_engine_under_load(api: str, engine_pid: int, num_streams: int = 4,
                                 num_plain: int = 4, max_tokens: int = 400,
                                 deadline_s: float = 30.0) -> KillResult:
    """Start the requests, wait until every stream has had a token, kill the engine, and wait up
    to `deadline_s` for every request to end (those still open then have no seconds_to_end)."""
    clock = _Clock()
    flowing = [asyncio.Event() for _ in range(num_streams)]
    body = {"prompt": "Count from one to one thousand:", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    ends = [RequestEnd(is_stream=True) for _ in range(num_streams)]
    ends += [RequestEnd(is_stream=False) for _ in range(num_plain)]

    async def stream(client: httpx.AsyncClient, end: RequestEnd, has_flowed: asyncio.Event) -> None:
        async with client.stream("POST", f"{api}/completions",
                                 json={**body, "stream": True}) as response:
            end.status = response.status_code
            async for line in response.aiter_lines():
                if not line:
                    continue
                if clock.killed_at is None:
                    end.num_events_before_kill += 1
                    has_flowed.set()
                    continue
                end.events_after_kill.append(line)
                payload = line.removeprefix("data: ")
                if end.error is None and payload.startswith("{") and '"error"' in payload:
                    end.error = json.loads(payload).get("error")
                    end.seconds_to_error = clock.since_kill()

    async def plain(client: httpx.AsyncClient, end: RequestEnd) -> None:
        response = await client.post(f"{api}/completions", json=body)
        end.status = response.status_code
        if response.status_code != 200:
            end.error = response.json().get("error")
            end.seconds_to_error = clock.since_kill()

    async def run(coroutine, end: RequestEnd) -> None:
        try:
            await coroutine
        except httpx.HTTPError as error:
            end.transport_error = f"{type(error).__name__}: {error}"
        end.seconds_to_end = clock.since_kill()

    limits = httpx.Limits(max_connections=num_streams + num_plain + 4)
    async with httpx.AsyncClient(timeout=deadline_s + 60, limits=limits) as client:
        tasks = [asyncio.ensure_future(run(stream(client, end, event), end))
                 for end, event in zip(ends, flowing)]
        tasks += [asyncio.ensure_future(run(plain(client, end), end))
                  for end in ends[num_streams:]]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing)), 120)
        if any(task.done() for task in tasks):
            raise RuntimeError("a request ended before the kill: raise max_tokens")
        clock.killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return KillResult(clock.killed_at, ends)
