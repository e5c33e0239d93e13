"""A response_format grammar compiles on a thread, not on the engine loop: while one request's schema
compiles (held here until the test lets it go), the loop keeps stepping another request, takes new
messages and aborts; a compile that fails refuses its request alone."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from types import SimpleNamespace

from engine.engine_process import EngineLoop
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    RequestRejected,
    Shutdown,
    StepStats,
    decode,
    encode,
)
from engine.sampling_params import SamplingParams
from engine.step.types import StepResult
from engine.structured import UnsupportedSchemaError

SCHEMA_KEY = '{"type":"json_object"}'
BAD_KEY = '{"schema":{"uniqueItems":true},"type":"json_schema"}'


class HeldCompiler:
    """compile_key blocks until released; BAD_KEY fails as an unenforceable schema does."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def compile_key(self, key: str):
        if key == BAD_KEY:
            raise UnsupportedSchemaError("response_format.json_schema.schema cannot be enforced")
        self.started.set()
        assert self.release.wait(30), "the test never released the compile"
        return SimpleNamespace(key=key)


class CountingCore:
    """Steps every added request; records what was added with which grammar."""

    def __init__(self, compiler: HeldCompiler) -> None:
        self.compiler = compiler
        self.added: dict[str, object] = {}
        self.num_steps = 0

    def grammar_compiler(self) -> HeldCompiler:
        return self.compiler

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None, grammar=None):
        self.added[request_id] = grammar

    def abort(self, request_ids):
        for request_id in request_ids:
            self.added.pop(request_id, None)
        return []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.added)

    def step(self):
        self.num_steps += 1
        return StepResult([], StepStats())


class Sockets:
    """inbox/outbox stand-ins: the test puts encoded messages in, reads what the loop sent."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[bytes] = queue.Queue()
        self.sent: list[object] = []

    def poll(self, timeout_ms: int) -> bool:
        try:
            self._next = self.inbox.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return False
        return True

    def recv(self) -> bytes:
        return self._next

    def send(self, data: bytes) -> None:
        self.sent.append(decode(data))


def add(request_id: str, response_format: str | None) -> bytes:
    return encode(AddRequest(request_id, [1, 2, 3],
                             SamplingParams(max_tokens=4, response_format=response_format)))


def wait_until(condition, timeout: float = 10.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@contextlib.contextmanager
def running_loop() -> Iterator[tuple[HeldCompiler, CountingCore, Sockets]]:
    """An EngineLoop on its own thread over a held compiler; released and shut down on exit."""
    compiler = HeldCompiler()
    core, sockets = CountingCore(compiler), Sockets()
    thread = threading.Thread(target=EngineLoop(core, sockets, sockets, os.getppid()).run,
                              daemon=True)
    thread.start()
    try:
        yield compiler, core, sockets
    finally:
        compiler.release.set()
        sockets.inbox.put(encode(Shutdown()))
        thread.join(10)
    assert not thread.is_alive()


def test_the_loop_steps_other_requests_while_a_grammar_compiles():
    with running_loop() as (compiler, core, sockets):
        sockets.inbox.put(add("schema", SCHEMA_KEY))
        assert compiler.started.wait(10)
        sockets.inbox.put(add("plain", None))
        wait_until(lambda: core.num_steps >= 20)  # steps go on while the compile is held
        assert "schema" not in core.added and "plain" in core.added
        compiler.release.set()
        wait_until(lambda: "schema" in core.added)
        assert core.added["schema"].key == SCHEMA_KEY  # added with the grammar compiled off-loop


def test_a_failed_compile_refuses_its_request_alone_and_aborts_reach_pending_ones():
    with running_loop() as (compiler, core, sockets):
        sockets.inbox.put(add("plain", None))
        sockets.inbox.put(add("bad", BAD_KEY))
        sockets.inbox.put(add("aborted", SCHEMA_KEY))
        assert compiler.started.wait(10)
        sockets.inbox.put(encode(AbortRequests(["aborted"])))
        wait_until(lambda: any(isinstance(m, RequestRejected) for m in sockets.sent))
        compiler.release.set()
        wait_until(lambda: core.num_steps >= 5)
    rejected = [m for m in sockets.sent if isinstance(m, RequestRejected)]
    assert [m.request_id for m in rejected] == ["bad"]
    assert "cannot be enforced" in rejected[0].message
    assert set(core.added) == {"plain"}  # the aborted one never joined the scheduler
    assert all(isinstance(m, (RequestRejected, EngineOutputs)) for m in sockets.sent)
