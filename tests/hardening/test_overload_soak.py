"""Bounded overload soak on loopback: more requests than the queue holds, streaming and not, some
clients leaving mid-answer. Every request that stays ends complete or with a 429/503 in OpenAI's
shape, none hangs, and afterwards the server holds nothing (no KV blocks, no queued request)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest
from live_server import LiveServer
from openai_errors import assert_openai_error
from tiny_chat_model import VOCAB_SIZE

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

SEED = 20261123
NUM_REQUESTS = 80
# the first requests arrive together (surely beyond the queue), the rest spread over the window
NUM_BURST = 16
ARRIVAL_WINDOW_S = 8.0
MAX_NUM_SEQS = 4
MAX_WAITING = 8
# generous: proves a request ends, not how fast (speed is measured elsewhere)
REQUEST_DEADLINE_S = 60.0
SETTLE_S = 10.0
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})


@dataclass
class Plan:
    """One client of the soak, drawn from the seeded random generator."""

    delay: float
    body: dict
    # streams: leave after this many events; non-streams: give up after this many seconds
    leave_after_events: int | None = None
    give_up_after_s: float | None = None


@dataclass
class Outcome:
    status: int | None = None
    body: bytes = b""
    retry_after: str | None = None
    events: list[str] | None = None
    seconds: float = 0.0
    has_left: bool = False
    is_hung: bool = False


def make_plans(rng: random.Random) -> list[Plan]:
    plans = []
    for index in range(NUM_REQUESTS):
        delay = 0.0 if index < NUM_BURST else rng.uniform(0.0, ARRIVAL_WINDOW_S)
        pattern = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(2, 5))]
        body = {"prompt": pattern * rng.randint(1, 6), "max_tokens": rng.randint(4, 100),
                "n": rng.choice([1, 1, 1, 2]), "ignore_eos": rng.random() < 0.5,
                "stream": rng.random() < 0.5}
        if rng.random() < 0.5:
            body.update(temperature=0.8, seed=rng.randrange(1000))
        else:
            body.update(temperature=0)
        if rng.random() < 0.15:
            body["speculative_decoding"] = {"enabled": False}
        plan = Plan(delay, body)
        if body["stream"] and rng.random() < 0.4:
            plan.leave_after_events = rng.randint(1, 4)
        elif not body["stream"] and rng.random() < 0.2:
            plan.give_up_after_s = rng.uniform(0.2, 1.0)
        plans.append(plan)
    return plans


async def run_client(client: httpx.AsyncClient, api: str, plan: Plan) -> Outcome:
    await asyncio.sleep(plan.delay)
    outcome = Outcome()
    start = time.monotonic()
    try:
        await asyncio.wait_for(_exchange(client, api, plan, outcome), REQUEST_DEADLINE_S)
    except asyncio.TimeoutError:
        if plan.give_up_after_s is None:
            outcome.is_hung = True
        outcome.has_left = True
    outcome.seconds = time.monotonic() - start
    return outcome


async def _exchange(client: httpx.AsyncClient, api: str, plan: Plan, outcome: Outcome) -> None:
    url = f"{api}/completions"
    if not plan.body["stream"]:
        if plan.give_up_after_s is not None:  # the client goes away: the server must abort it
            try:
                response = await asyncio.wait_for(client.post(url, json=plan.body),
                                                  plan.give_up_after_s)
            except asyncio.TimeoutError:
                outcome.has_left = True
                return
        else:
            response = await client.post(url, json=plan.body)
        outcome.status, outcome.body = response.status_code, response.content
        outcome.retry_after = response.headers.get("retry-after")
        return
    async with client.stream("POST", url, json=plan.body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.body = await response.aread()
            outcome.retry_after = response.headers.get("retry-after")
            return
        outcome.events = []
        async for line in response.aiter_lines():
            if not line:
                continue
            outcome.events.append(line)
            if plan.leave_after_events is not None and len(outcome.events) >= plan.leave_after_events:
                outcome.has_left = True  # leaving the block closes the connection mid-stream
                return


def check_complete(plan: Plan, outcome: Outcome) -> None:
    """A 200 answer is whole: each choice has a finish reason, streams end with [DONE]."""
    n, max_tokens = plan.body["n"], plan.body["max_tokens"]
    if outcome.events is None:
        answer = json.loads(outcome.body)
        assert len(answer["choices"]) == n
        assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        assert answer["usage"]["completion_tokens"] <= n * max_tokens
        if plan.body["ignore_eos"]:
            assert answer["usage"]["completion_tokens"] == n * max_tokens
        return
    assert outcome.events[-1] == "data: [DONE]", outcome.events[-3:]
    chunks = [json.loads(line.removeprefix("data: ")) for line in outcome.events[:-1]]
    assert not any("error" in chunk for chunk in chunks), chunks
    reasons = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"]
               if c["finish_reason"] is not None}
    assert sorted(reasons) == list(range(n)) and set(reasons.values()) <= {"stop", "length"}


async def soak(server: LiveServer, plans: list[Plan]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 8)
    async with httpx.AsyncClient(timeout=REQUEST_DEADLINE_S, limits=limits) as client:
        return await asyncio.gather(*(run_client(client, server.api, plan) for plan in plans))


def settled(server: LiveServer) -> dict[str, float]:
    """The scheduler gauges once they read zero, or their last values after SETTLE_S."""
    names = ("specserve:kv_cache_usage_perc", "specserve:num_requests_running",
             "specserve:num_requests_waiting")
    deadline = time.monotonic() + SETTLE_S
    while True:
        values = {name: server.metric(name) for name in names}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_chat_llama):
    # NOTE: a model with a tokenizer, so streams send text as it comes (and clients can leave
    # mid-answer); without one, a stream's only event would be its last
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32", "--max-model-len", "512",
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                     "--speculative-config", NGRAM]) as server:
        yield server


def test_overload_soak_ends_every_request_and_leaks_nothing(server):
    plans = make_plans(random.Random(SEED))
    outcomes = asyncio.run(soak(server, plans))

    assert not [o for o in outcomes if o.is_hung], "requests hung past the deadline"
    stayed = [(p, o) for p, o in zip(plans, outcomes) if not o.has_left]
    codes = [o.status for _, o in stayed]
    assert set(codes) <= {200, 429, 503}, codes
    assert codes.count(200) > 0 and codes.count(429) > 0, "the soak did not overload the server"
    for plan, outcome in stayed:
        if outcome.status == 200:
            check_complete(plan, outcome)
        else:
            assert_openai_error(outcome.body)
            if outcome.status == 429:
                assert outcome.retry_after == "1"

    # every 429 a client saw was counted; a client that gave up may not have seen its own
    num_429 = sum(o.status == 429 for o in outcomes)
    num_unknown = sum(o.status is None for o in outcomes)
    rejected = server.metric("specserve:request_rejected_total")
    assert num_429 <= rejected <= num_429 + num_unknown

    assert settled(server) == {"specserve:kv_cache_usage_perc": 0,
                               "specserve:num_requests_running": 0,
                               "specserve:num_requests_waiting": 0}
    # the waiting count came back to zero too: a burst of exactly the queue's size is all served
    burst = [Plan(0.0, {"prompt": [1, 2, 3], "max_tokens": 8, "n": 1, "ignore_eos": True,
                        "stream": False, "temperature": 0}) for _ in range(MAX_WAITING)]
    assert [o.status for o in asyncio.run(soak(server, burst))] == [200] * MAX_WAITING
    log = server.output()
    assert "Traceback" not in log, log[log.find("Traceback") - 300:][:6000]
