"""The engine process behind EngineClient: requests stream back, aborts free blocks, bad requests are
rejected, and a killed engine fails every waiting request instead of leaving it hanging."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.engine_args import EngineArgs
from engine.messages import StepStats
from engine.sampling_params import SamplingParams
from server.engine_client import EngineClient, EngineDeadError, RequestRejectedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def collect(queue) -> list:
    deltas = []
    while True:
        item = await asyncio.wait_for(queue.get(), 60)
        if isinstance(item, Exception):
            raise item
        deltas.append(item)
        if item.finish_reason is not None:
            return deltas


def run_client(checkpoint: str, body, **engine) -> None:
    async def main():
        stats: list[StepStats] = []
        dead = asyncio.Event()
        settings = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32, **engine}
        client = EngineClient(EngineArgs(model=checkpoint, **settings),
                              on_stats=stats.append, on_dead=dead.set)
        await client.start(timeout=120)
        try:
            await body(client, stats, dead)
        finally:
            await client.shutdown()
    asyncio.run(main())


def test_requests_stream_back_with_stats(tiny_llama):
    async def body(client, stats, dead):
        assert client.ready.max_model_len == 128 and client.ready.speculative_method == "ngram"
        queues = [await client.add_request(f"r{i}", [1, 5, 9, 5, 9, 5, 9], GREEDY) for i in range(3)]
        results = await asyncio.gather(*(collect(q) for q in queues))
        for deltas in results:
            assert sum(len(d.new_token_ids) for d in deltas) == 8
            assert deltas[-1].finish_reason == "length"
            assert deltas[-1].spec_stats.num_draft_tokens >= 0
        token_ids = [[t for d in deltas for t in d.new_token_ids] for deltas in results]
        assert token_ids[0] == token_ids[1] == token_ids[2]
        assert sum(s.num_generation_tokens for s in stats) == 24
        assert stats[-1].kv_cache_usage == 0.0 and stats[-1].num_running == 0
    run_client(tiny_llama, body, speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_abort_frees_blocks_and_bad_requests_are_rejected(tiny_llama):
    async def body(client, stats, dead):
        queue = await client.add_request("long", [1, 2, 3],
                                         SamplingParams(temperature=0.0, max_tokens=100,
                                                        ignore_eos=True))
        await asyncio.wait_for(queue.get(), 60)  # it is running
        await client.abort(["long"])
        bad = await client.add_request("bad", [1, 10_000], GREEDY)  # token id outside the vocab
        with pytest.raises(RequestRejectedError, match="token ids"):
            await collect(bad)
        ok = await collect(await client.add_request("after", [1, 2], GREEDY))
        assert ok[-1].finish_reason == "length"
        assert stats[-1].kv_cache_usage == 0.0
    run_client(tiny_llama, body)


def test_killed_engine_fails_in_flight_requests(tiny_llama):
    async def body(client, stats, dead):
        queue = await client.add_request("victim", [1, 2, 3],
                                         SamplingParams(temperature=0.0, max_tokens=400,
                                                        ignore_eos=True))
        await asyncio.wait_for(queue.get(), 60)
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            await collect(queue)
        await asyncio.wait_for(dead.wait(), 10)
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            await client.add_request("late", [1, 2], GREEDY)
    run_client(tiny_llama, body, max_model_len=512, num_kv_blocks=64)


def test_shutdown_ends_when_the_engine_never_connected(tiny_llama):
    """A failed start-up can leave a process alive that never connected its socket (it dies while
    shutdown() looks): handing it the Shutdown message must not wait for a peer forever, it is
    killed instead. (A bare send on the PUSH socket hung `specserve serve` on a bad head folder.)"""

    class NeverConnected:
        """Alive until killed, like an engine process stuck before its first connect."""

        def __init__(self) -> None:
            self.killed = False

        def is_alive(self) -> bool:
            return not self.killed

        def join(self, timeout: float | None = None) -> None:
            pass

        def kill(self) -> None:
            self.killed = True

    async def main():
        client = EngineClient(EngineArgs(model=tiny_llama))
        client._to_engine.bind(f"ipc://{client._socket_dir}/input")
        client._process = process = NeverConnected()
        await asyncio.wait_for(client.shutdown(timeout=0.1), 30)
        assert process.killed

    asyncio.run(main())
