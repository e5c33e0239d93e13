"""One bounded run: send requests on their arrival schedule (and under a concurrency cap, if any)
until the request count is reached or the duration limit passes; at the limit, requests still in
flight are cancelled and counted as failed, so every sent request is accounted for."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from loadtest.client import RequestOutcome, send_streaming
from loadtest.target import Endpoint

CANCELLED_ERROR = "cancelled at the duration limit"


@dataclass(frozen=True)
class RunBounds:
    """How a run is paced and where it stops."""

    send_offsets: list[float]       # seconds after the start at which each request is due
    max_concurrency: int | None     # requests in flight at most; None = no cap
    duration_s: float               # hard limit on the whole run


@dataclass
class RunOutcome:
    """Every sent request's outcome, in send order, and the run's wall time."""

    outcomes: list[RequestOutcome]
    duration: float   # seconds from the start to the last request's end (or the deadline)

    @property
    def num_sent(self) -> int:
        return len(self.outcomes)


def run_load(endpoint: Endpoint, bodies: list[dict], bounds: RunBounds,
             transport: httpx.AsyncBaseTransport | None = None) -> RunOutcome:
    """Run it from synchronous code (a fresh event loop per run). `transport` replaces the
    network, so tests can check pacing and the deadline without a server."""
    return asyncio.run(_run_load(endpoint, bodies, bounds, transport))


def load_client(transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """An HTTP client for a bounded run: no connection cap and no read timeout, because the run's
    duration limit is what ends a slow request."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport)


async def _run_load(endpoint: Endpoint, bodies: list[dict], bounds: RunBounds,
                    transport: httpx.AsyncBaseTransport | None) -> RunOutcome:
    if bounds.duration_s <= 0:
        raise ValueError(f"the duration limit must be > 0 s, got {bounds.duration_s}")
    async with load_client(transport) as client:
        start = time.perf_counter()
        deadline = start + bounds.duration_s
        slots = asyncio.Semaphore(bounds.max_concurrency) if bounds.max_concurrency else None
        tasks: list[asyncio.Task[RequestOutcome]] = []
        send_times: list[float] = []

        async def send_and_free_slot(body: dict) -> RequestOutcome:
            try:
                return await send_streaming(client, endpoint, body, start)
            finally:
                if slots is not None:
                    slots.release()

        for body, offset in zip(bodies, bounds.send_offsets):
            if start + offset >= deadline:
                break
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if slots is not None and not await _acquire_before(slots, deadline):
                break
            send_times.append(time.perf_counter() - start)
            tasks.append(asyncio.create_task(send_and_free_slot(body)))

        pending: set[asyncio.Task[RequestOutcome]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start

    outcomes = []
    for task, sent_at in zip(tasks, send_times):
        if task.cancelled():
            outcomes.append(RequestOutcome(is_success=False, start_time=sent_at,
                                           error=f"{CANCELLED_ERROR} ({bounds.duration_s:g} s)"))
        else:
            outcomes.append(task.result())
    return RunOutcome(outcomes, duration)


async def _acquire_before(slots: asyncio.Semaphore, deadline: float) -> bool:
    """Wait for a free slot until the deadline; False if none came in time."""
    try:
        await asyncio.wait_for(slots.acquire(), timeout=max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        return False
    if time.perf_counter() >= deadline:
        slots.release()
        return False
    return True
