"""The server's edges on a tiny model: bad flags fail at start-up, a full queue answers 429 with
Retry-After, SIGTERM drains in-flight requests, and a killed engine ends in-flight requests with an
error and the server with a non-zero exit code."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from live_server import LiveServer, engine_pid

from server.cli import main

# generous deadlines: they prove a request ends, not how fast (speed is measured elsewhere)
DEADLINE_S = 60


BAD_FLAGS = [
    (["--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}'], "nope"),
    (["--speculative-config", "{not json"], "JSON"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--model", "/no/such/model"], "no such file"),
    (["--dtype", "int3"], "dtype"),
    (["--quantization", "q4"], "--quantization"),
    (["--port", "70000"], "--port"),
    (["--max-body-mib", "0"], "--max-body-mib"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_flags_fail_at_start_up(flags, message, capsys, monkeypatch):
    """In this process (each check runs before the engine process would start): exit code 2 and
    the message, no traceback."""
    import server.engine_launch

    def no_launch(*args, **kwargs):
        raise AssertionError(f"{flags} reached the engine's launch")

    monkeypatch.setattr(server.engine_launch, "launch_engine", no_launch)
    assert main(["serve", *flags]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and "Traceback" not in stderr


def test_the_real_command_exits_2_on_a_bad_flag():
    """`python -m server.cli serve` as a deployment runs it: the exit code reaches the shell."""
    flags, message = BAD_FLAGS[0]
    result = subprocess.run([sys.executable, "-m", "server.cli", "serve", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def spec_methods(server: LiveServer) -> dict[str, float]:
    """spec_method label -> the configured k the server exports."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {s.labels["spec_method"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "specserve:spec_decode_num_speculative_tokens"}


@pytest.mark.slow
def test_plain_serve_speculates_with_adaptive_suffix_and_none_turns_it_off(tiny_llama):
    prompt = completion([1, 5, 9, 13, 2, 7, 5, 9, 13, 2], 24)
    for flags, expected in (([], {"suffix": 8}), (["--speculative-config", "none"], {"none": 0})):
        with LiveServer(["--model", tiny_llama, "--dtype", "float32", "--max-model-len", "512",
                         *flags]) as server:
            assert spec_methods(server) == expected
            response = httpx.post(f"{server.api}/completions", json=prompt, timeout=DEADLINE_S)
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 24


def completion(token_ids: list[int], max_tokens: int, **extra) -> dict:
    return {"prompt": token_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


@pytest.mark.slow
def test_full_queue_answers_429_with_retry_after(tiny_llama):
    with LiveServer(["--model", tiny_llama, "--dtype", "float32", "--max-model-len", "512",
                     "--max-num-seqs", "1", "--max-waiting-requests", "2"]) as server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await asyncio.gather(*(
                    client.post(f"{server.api}/completions", json=completion([1, 2, 3], 300))
                    for _ in range(8)))
        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429} and codes.count(200) >= 2
        for response in responses:
            if response.status_code == 429:
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["type"] == "RateLimitError"
        assert server.metric("specserve:request_rejected_total") == codes.count(429)
        # the queue drains: a new request is served again
        assert httpx.post(f"{server.api}/completions", json=completion([1, 2], 4),
                          timeout=DEADLINE_S).status_code == 200


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(tiny_llama):
    with LiveServer(["--model", tiny_llama, "--dtype", "float32", "--max-model-len", "512",
                     "--drain-timeout", "60"]) as server:
        async def scenario() -> tuple[httpx.Response, int | str]:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                in_flight = asyncio.ensure_future(
                    client.post(f"{server.api}/completions", json=completion([1, 2, 3], 480)))
                await asyncio.sleep(0.5)  # it is running
                server.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                try:
                    late = (await client.post(f"{server.api}/completions",
                                              json=completion([1, 2], 4))).status_code
                except httpx.TransportError as error:  # the listener is already closed
                    late = type(error).__name__
                return await in_flight, late
        response, late = asyncio.run(scenario())
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 480
        assert late in (503, "ConnectError", "RemoteProtocolError", "ReadError")
        assert server.process.wait(DEADLINE_S) == 0


@pytest.mark.promise("failure-isolation")
def test_killed_engine_fails_requests_and_the_server_exits_non_zero(tiny_llama):
    with LiveServer(["--model", tiny_llama, "--dtype", "float32", "--max-model-len", "512"]) as server:
        engine = engine_pid(server.process.pid)
        os.kill(engine, signal.SIGSTOP)  # NOTE: frozen, so the request is surely still in flight

        async def scenario() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                in_flight = asyncio.ensure_future(
                    client.post(f"{server.api}/completions", json=completion([1, 2, 3], 100)))
                await asyncio.sleep(0.5)
                assert not in_flight.done()
                killed_at = time.monotonic()
                os.kill(engine, signal.SIGKILL)
                response = await in_flight
                return response, time.monotonic() - killed_at
        response, seconds = asyncio.run(scenario())
        assert response.status_code == 503
        assert "exited unexpectedly" in response.json()["error"]["message"]
        assert seconds < DEADLINE_S
        assert server.process.wait(DEADLINE_S) == 1
        assert "exited unexpectedly" in server.output()
