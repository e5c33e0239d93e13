"""The bounded run loop over a fake transport (no server): every sent request is accounted for,
refusals are failures with their status, the deadline cancels what is in flight, the concurrency
cap holds and no request leaves before its arrival time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loadtest.client import SamplingOptions, request_body
from loadtest.datasets import LoadRequest
from loadtest.runner import CANCELLED_ERROR, RunBounds, run_load
from loadtest.target import Endpoint

ENDPOINT = Endpoint("http://127.0.0.1:9", "tiny", "chat", None)


def sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class FakeServer:
    """Answers by the prompt: "fast" streams three chunks, "hang" never finishes, "busy" is 429."""

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.max_in_flight = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["messages"][0]["content"]
        if prompt == "busy":
            return httpx.Response(429, headers={"Retry-After": "1"},
                                  json={"error": {"message": "queue full", "type": "RateLimit"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self.stream(hang=prompt == "hang"))

    async def stream(self, hang: bool):
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for word in ("a", " b", " c"):
            await asyncio.sleep(0.01)
            yield sse({"choices": [{"index": 0, "delta": {"content": word}}]})
            if hang:
                await asyncio.sleep(3600)
        yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
        # NOTE: counted out before [DONE]: the client stops reading there, so code after the
        # last yield would only run when the stream is garbage-collected
        self.num_in_flight -= 1
        yield b"data: [DONE]\n\n"


def bodies(*prompts: str) -> list[dict]:
    sampling = SamplingOptions(max_tokens=4)
    return [request_body(LoadRequest(None, p, None, "test"), ENDPOINT, sampling) for p in prompts]


def run(prompts: list[str], offsets: list[float], concurrency: int | None = None,
        duration_s: float = 30.0, server: FakeServer | None = None):
    server = server or FakeServer()
    transport = httpx.MockTransport(server.handle)
    return run_load(ENDPOINT, bodies(*prompts), RunBounds(offsets, concurrency, duration_s),
                    transport=transport)


def test_successes_and_refusals_are_all_accounted_for():
    result = run(["fast", "busy", "fast"], [0.0, 0.0, 0.0])
    assert result.num_sent == 3
    fast, busy, _ = result.outcomes
    assert fast.is_success and fast.generated_text == "a b c"
    assert (fast.input_len, fast.output_len, len(fast.itls)) == (7, 4, 2)
    assert 0 < fast.ttft <= fast.latency
    assert not busy.is_success and busy.status_code == 429
    assert busy.error == "HTTP 429: queue full"


def test_the_deadline_cancels_requests_in_flight_and_stops_sending():
    # the third request is due after the deadline, so it is never sent
    result = run(["fast", "hang", "fast"], [0.0, 0.0, 5.0], duration_s=0.5)
    assert result.num_sent == 2
    assert result.outcomes[0].is_success
    assert result.outcomes[1].error.startswith(CANCELLED_ERROR)
    assert result.duration == pytest.approx(0.5, abs=0.4)


def test_the_concurrency_cap_holds():
    server = FakeServer()
    result = run(["fast"] * 6, [0.0] * 6, concurrency=2, server=server)
    assert all(outcome.is_success for outcome in result.outcomes)
    assert server.max_in_flight == 2


def test_no_request_leaves_before_its_arrival_time():
    offsets = [0.0, 0.05, 0.1, 0.3]
    result = run(["fast"] * 4, offsets)
    assert [o.start_time >= due for o, due in zip(result.outcomes, offsets)] == [True] * 4
