"""SIGKILL to the engine while streams and plain requests are generating: every in-flight request
ends with an error (streams: an SSE error event, then the end of the stream; plain requests: 503),
/health turns 503, and the server exits non-zero so an orchestrator restarts it."""

from __future__ import annotations

import asyncio

import pytest
from engine_kill import kill_engine_under_load
from live_server import LiveServer, assert_health_is_503, engine_pid, launcher_exiting_late
from openai_errors import assert_openai_error

# a live server of its own: the full suite's
pytestmark = pytest.mark.slow

# generous deadlines: they prove requests end, not how fast (benchmarks/bench_engine_kill.py
# measures that)
DEADLINE_S = 30.0
NUM_STREAMS = 4
NUM_PLAIN = 4


def test_engine_killed_under_load_fails_every_request_and_the_server(tiny_chat_llama):
    # NOTE: the server exits 6 s after the kill instead of at once, so that /health can be seen
    # answering 503 (a probe racing the closing listener proved nothing)
    with LiveServer(["--model", tiny_chat_llama, "--dtype", "float32",
                     "--max-model-len", "512"], launcher=launcher_exiting_late(6.0)) as server:
        ends = asyncio.run(kill_engine_under_load(
            server.api, engine_pid(server.process.pid), NUM_STREAMS, NUM_PLAIN, max_tokens=480,
            deadline_s=DEADLINE_S)).ends

        assert all(end.seconds_to_end is not None for end in ends), "a request outlived the deadline"
        for end in ends:
            assert end.transport_error is None, end
            assert end.seconds_to_error is not None and end.seconds_to_error <= end.seconds_to_end
            error = assert_openai_error({"error": end.error})
            assert error["type"] == "ServiceUnavailableError"
            assert "exited unexpectedly" in error["message"]
        for end in ends[:NUM_STREAMS]:
            assert end.status == 200 and end.num_events_before_kill > 0
            # the error is the stream's last word: no tokens after it, then [DONE] and the end
            events = end.events_after_kill
            error_at = next(i for i, e in enumerate(events) if '"error"' in e)
            assert events[error_at + 1:] == ["data: [DONE]"], events
        for end in ends[NUM_STREAMS:]:
            assert end.status == 503

        # the same server that answered 200 when it started (LiveServer waits for it) says 503
        assert_health_is_503(server.url)
        assert server.process.wait(DEADLINE_S) == 1
        assert "exited unexpectedly" in server.output()
