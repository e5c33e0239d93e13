"""The task that routes the engine's outputs to requests is watched like the engine process: if it
fails (a malformed message, a bug in a callback), every in-flight request gets EngineDeadError,
the client reports the engine dead (so /health answers 503), the engine process is stopped, and a
live server exits non-zero. Deadlines are generous: they prove it ends, not how fast."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time

import httpx
import pytest
import zmq
import zmq.asyncio
from live_server import LiveServer, assert_health_is_503, engine_pid, launcher_exiting_late

from engine.engine_args import EngineArgs
from engine.sampling_params import SamplingParams
from server.engine_client import EngineClient, EngineDeadError

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

DEADLINE_S = 30.0
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


async def until_error(queue: asyncio.Queue) -> Exception:
    """Read a request's deltas until its error; it must not finish normally first."""
    while True:
        item = await queue.get()
        if isinstance(item, Exception):
            return item
        assert item.finish_reason is None, "the request finished instead of failing"


async def fail_the_router(tiny_llama: str, inject) -> None:
    """Three requests streaming, then `inject(client)` breaks the output router."""
    dead = asyncio.Event()
    is_armed = False

    def on_stats(stats) -> None:
        if is_armed:
            raise RuntimeError("injected on_stats failure")

    client = EngineClient(EngineArgs(model=tiny_llama, dtype="float32", max_model_len=512,
                                     num_kv_blocks=128),
                          on_stats=on_stats, on_dead=dead.set)
    await client.start(timeout=120)
    try:
        queues = [await client.add_request(f"r{i}", [1, 2, 3], LONG) for i in range(3)]
        for queue in queues:  # every request is generating
            assert not isinstance(await asyncio.wait_for(queue.get(), 60), Exception)
        is_armed = inject is None
        if inject is not None:
            await inject(client)
        errors = await asyncio.wait_for(asyncio.gather(*map(until_error, queues)), DEADLINE_S)
        for error in errors:
            assert isinstance(error, EngineDeadError)
            assert "engine-output-router failed" in str(error)
        await asyncio.wait_for(dead.wait(), DEADLINE_S)
        assert not client.is_alive
        assert client.num_in_flight == 0
        with pytest.raises(EngineDeadError):
            await client.add_request("late", [1, 2], LONG)
        # nothing is left running: the engine process was stopped
        await asyncio.to_thread(client._process.join, DEADLINE_S)
        assert not client._process.is_alive()
    finally:
        await client.shutdown()


def test_a_failing_stats_callback_fails_every_request(tiny_llama):
    """on_stats raises inside the router (inject None: arm the callback)."""
    asyncio.run(fail_the_router(tiny_llama, None))


def test_a_malformed_message_fails_every_request(tiny_llama):
    async def send_garbage(client: EngineClient) -> None:
        context = zmq.asyncio.Context()
        intruder = context.socket(zmq.PUSH)
        intruder.connect(f"ipc://{client._socket_dir}/output")
        await intruder.send(b"not a msgpack message")
        intruder.close(linger=1000)
        context.term()

    asyncio.run(fail_the_router(tiny_llama, send_garbage))


# the real `specserve serve`, with a stats callback that raises from the first engine step on (and,
# so that /health can be seen answering 503, an exit 6 s after the engine is found dead)
FAULTY_STATS = textwrap.dedent("""
    def on_stats(self, stats):
        raise RuntimeError("injected on_stats failure")

    server.serve.EngineCallbacks.on_stats = on_stats
""")


def test_a_live_server_with_a_failed_router_errors_and_exits_non_zero(tiny_llama):
    with LiveServer(["--model", tiny_llama, "--dtype", "float32", "--max-model-len", "512"],
                    launcher=launcher_exiting_late(6.0, FAULTY_STATS)) as server:
        engine = engine_pid(server.process.pid)
        body = {"model": "any", "prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True,
                "temperature": 0}
        models = httpx.get(f"{server.api}/models", timeout=10).json()
        body["model"] = models["data"][0]["id"]
        response = httpx.post(f"{server.api}/completions", json=body, timeout=DEADLINE_S)
        assert response.status_code == 503
        assert "engine-output-router failed" in response.json()["error"]["message"]
        # the same server that answered 200 when it started (LiveServer waits for it) says 503
        assert_health_is_503(server.url)
        assert server.process.wait(DEADLINE_S) == 1
        assert "injected on_stats failure" in server.output()
        assert _has_exited(engine, DEADLINE_S), "the engine process is still running"


def _has_exited(pid: int, timeout: float) -> bool:
    """Whether process `pid` is gone (exited and reaped) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
